"""Cluster model, cost model and planner for hybrid-cp meshes."""
