"""Calibration: fitted rates equal the rates a fake source was fed; the model's new terms vanish in the
ideal limit; calibrated cluster files round-trip through the CLI; a short real calibrate + bench."""

from __future__ import annotations

import json

import pytest
from tolerance import relative_difference, within

from hybrid_cp.cli import measure
from topology import Cluster, ModelShape, estimate
from topology.calibrated import engine_known_s
from topology.calibration import (
    A2AFit,
    Calibration,
    CalibrationSpec,
    KernelFit,
    LinkFit,
    collect,
    default_spec,
    fit,
    heads_per_call,
    kernel_flops,
)

# ------------------------------------------------------------------------------------------------ fake source

TRUE_KERNELS = {  # (causal, direction) -> (TFLOP/s, call overhead us, causal tile tokens, io ns per element)
    (True, "fwd"): (0.02, 300.0, 180.0, 0.0),  # a causal square block's IO is proportional to F / Tq:
    (True, "bwd"): (0.011, 700.0, 250.0, 0.0),  # the tile term carries it
    (False, "fwd"): (0.03, 200.0, 0.0, 2.0),
    (False, "bwd"): (0.015, 450.0, 0.0, 0.0),
}
TRUE_HEAD_US = {
    (True, "fwd"): 40.0,
    (True, "bwd"): 90.0,
    (False, "fwd"): 25.0,
    (False, "bwd"): 0.0,
}  # per head per call
TRUE_MERGE = LinkFit(bandwidth_gb_s=3.0, latency_us=120.0)
TRUE_A2A = {2: (0.8, 900.0, 1.6, 500.0), 4: (0.5, 1500.0, 0.9, 800.0), 8: (0.3, 2500.0, None, None)}
TRUE_P2P, TRUE_P2P_ALONE = LinkFit(bandwidth_gb_s=0.4, latency_us=1000.0), LinkFit(bandwidth_gb_s=1.2, latency_us=300.0)
TRUE_OVERLAP, TRUE_STEP_US, TRUE_CALL_US, TRUE_COPY = 0.35, 800.0, 15000.0, 0.25


def _true_calibration(world: int = 8) -> Calibration:
    a2a = [
        A2AFit(
            ulysses=u,
            groups=world // u,
            link=LinkFit(bandwidth_gb_s=bw, latency_us=lat),
            alone=None if abw is None else LinkFit(bandwidth_gb_s=abw, latency_us=alat),
        )
        for u, (bw, lat, abw, alat) in TRUE_A2A.items()
    ]
    return Calibration(
        world=world,
        backend="gloo",
        kernel="sdpa",
        dtype="float32",
        merge=TRUE_MERGE,
        a2a=a2a,
        p2p=TRUE_P2P,
        p2p_alone=TRUE_P2P_ALONE,
        overlap=TRUE_OVERLAP,
    )


class FakeSource:
    """Deterministic timings from known rates, in the model's own functional forms."""

    def kernel(self, backend, dtype, causal, tq, tk, heads, kv_heads, head_dim):
        out = []
        for direction in ("fwd", "bwd"):
            rate, ovh, tile, io = TRUE_KERNELS[(causal, direction)]
            f = kernel_flops(tq, tk, heads, head_dim, causal, direction)
            out.append(
                (ovh + TRUE_HEAD_US[(causal, direction)] * heads) * 1e-6
                + io * 1e-9 * (tq + tk) * heads * head_dim
                + f * (1 + (tile / tq if causal else 0)) / (rate * 1e12)
            )
        return tuple(out)

    def merge(self, tokens, heads, head_dim, dtype):
        return TRUE_MERGE.seconds(tokens * heads * head_dim * (4 + 8))

    def a2a(self, ulysses, nbytes, alone):
        bw, lat, abw, alat = TRUE_A2A[ulysses]
        return LinkFit(bandwidth_gb_s=abw if alone else bw, latency_us=alat if alone else lat).seconds(nbytes)

    def p2p(self, nbytes, alone):
        return (TRUE_P2P_ALONE if alone else TRUE_P2P).seconds(nbytes)

    def overlap(self, tokens, heads, kv_heads, head_dim, dtype, backend, nbytes):
        c, k = (
            TRUE_P2P.seconds(nbytes),
            self.kernel(backend, dtype, False, tokens, tokens, heads, kv_heads, head_dim)[0],
        )
        return c, k, c + k - TRUE_OVERLAP * min(c, k)

    def engine(self, ulysses, ring, seq_len, heads, kv_heads, head_dim, dtype):
        known, nbytes = engine_known_s(_true_calibration(), ulysses, ring, seq_len, heads, kv_heads, head_dim, 4)
        return known + 3 * ring * TRUE_STEP_US * 1e-6 + TRUE_CALL_US * 1e-6 + nbytes / (TRUE_COPY * 1e9)


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    """math.isclose(a, b, rel_tol=rel, abs_tol=1e-9), recorded as one check per test: the fits recover rates fed
    without noise, so only the least-squares solve's fp64 round-off remains (worst 3.1e-11); the engine terms
    (1e-5) are fitted on the residual of the modelled terms (worst 5.7e-16)."""
    within(abs(a - b) / max(rel * max(abs(a), abs(b)), 1e-9) * rel, rel, f"fit recovers the rates fed (rel {rel:g})")
    return True


def test_fit_returns_exactly_the_rates_fed():
    spec = CalibrationSpec(world=8)
    lines: list[str] = []
    cal = fit(collect(FakeSource(), spec, lines.append), spec, backend="gloo", kernel_names={"auto": "sdpa"})
    assert lines and cal.kernel == "sdpa" and len(cal.kernels) == 4
    for (causal, direction), (rate, ovh, tile, io) in TRUE_KERNELS.items():
        k = cal.kernel_fit(causal, direction)
        assert _close(k.tflops, rate) and _close(k.call_overhead_us, ovh) and _close(k.causal_tile_tokens, tile)
        assert _close(k.io_ns_per_elem, io) and _close(k.head_call_overhead_us, TRUE_HEAD_US[(causal, direction)])
        within(k.rms_rel_error, 1e-9, f"kernel fit {causal} {direction} rms_rel_error")  # worst 5.7e-16
    assert _close(cal.merge.bandwidth_gb_s, 3.0) and _close(cal.merge.latency_us, 120.0)
    for u, (bw, lat, abw, alat) in TRUE_A2A.items():
        a = cal.a2a_fit(u)
        assert _close(a.link.bandwidth_gb_s, bw) and _close(a.link.latency_us, lat)
        if abw is None:
            assert a.alone is None and a.contention == 1.0
        else:
            assert _close(a.alone.bandwidth_gb_s, abw) and _close(a.contention, abw / bw)
    assert _close(cal.p2p.bandwidth_gb_s, 0.4) and _close(cal.p2p.latency_us, 1000.0)
    assert _close(cal.p2p_contention, 3.0)
    assert _close(cal.overlap, TRUE_OVERLAP)
    assert _close(cal.step_overhead_us, TRUE_STEP_US, 1e-5) and _close(cal.call_overhead_us, TRUE_CALL_US, 1e-5)
    assert _close(cal.copy_gb_s, TRUE_COPY, 1e-5)
    # what it could not measure is said, not hidden; where its time went is reported
    assert any("rest of the layer" in x for x in cal.not_measured)
    assert set(cal.stage_seconds) == {"probe", "kernels", "merge", "a2a", "p2p", "overlap", "engine"}


def test_failed_stage_is_reported_not_fatal():
    class Broken(FakeSource):
        def p2p(self, nbytes, alone):
            raise RuntimeError("no neighbour")

    spec = CalibrationSpec(world=8, stages=["kernels", "merge", "p2p"])
    cal = fit(collect(Broken(), spec), spec, backend="gloo")
    text = " | ".join(cal.not_measured)
    assert "p2p: RuntimeError: no neighbour" in text and "a2a: not requested" in text
    assert "engine fixed costs: not measured" in text and cal.p2p is None and len(cal.kernels) == 4


def test_kernel_efficiency_grows_with_block_size():
    k = KernelFit(
        backend="x",
        dtype="float32",
        causal=True,
        direction="fwd",
        tflops=0.02,
        call_overhead_us=300,
        causal_tile_tokens=200,
    )
    effs = [k.efficiency(t, t, 2, 64) for t in (128, 512, 2048, 8192)]
    assert effs == sorted(effs) and effs[0] < 0.6 and effs[-1] > 0.95


def test_kernel_grid_separates_heads_from_shape_terms():
    shapes = default_spec(8).kernel_shapes
    assert {h for _, _, h, _ in shapes} == set(heads_per_call(8, 8)) == {1, 2, 4, 8}
    # one head count at 4 lengths pins rate, call and tile/io; every other at 2 lengths on lines of equal T x heads
    causal = [(tq, h) for tq, _, h, c in shapes if c]
    assert len(shapes) == 20 and sorted(t for t, h in causal if h == 1) == [512, 1024, 2048, 4096]
    assert all(len({t * h for t, hh in causal if hh == h}) == 2 for h in (2, 4, 8))


def test_head_term_vanishes_in_the_ideal_limit_and_weighs_on_many_head_short_blocks():
    args = dict(
        backend="x",
        dtype="float32",
        causal=True,
        direction="fwd",
        tflops=0.02,
        call_overhead_us=300,
        causal_tile_tokens=200,
        io_ns_per_elem=0.5,
    )
    plain, heads = KernelFit(**args), KernelFit(**args, head_call_overhead_us=100.0)
    for tq, tk, h in ((128, 128, 8), (768, 384, 8), (6144, 6144, 1), (1000, 3000, 3)):
        f = kernel_flops(tq, tk, h, 64, True, "fwd")
        old = 300e-6 + 0.5e-9 * (tq + tk) * h * 64 + f * (1 + 200 / tq) / 0.02e12  # the block-size-only form
        # the same closed form evaluated two ways: fp64 round-off (worst 0); a difference of two seconds
        # (worst 1.1e-13: cancellation)
        within(relative_difference(plain.seconds(tq, tk, h, 64), old), 1e-12, f"plain {tq} {tk} {h}")
        within(
            relative_difference(heads.seconds(tq, tk, h, 64) - plain.seconds(tq, tk, h, 64), 100e-6 * h),
            1e-9,
            f"head term {tq} {tk} {h}",
        )
    # priced per call with the heads a ulysses rank holds: u=1 (8 heads, 8 short blocks) pays the most
    cal = _true_calibration()
    fits = lambda us: [
        KernelFit(
            backend="sdpa",
            dtype="float32",
            causal=c,
            direction=d,
            tflops=r,
            call_overhead_us=o,  # noqa: E731
            causal_tile_tokens=t,
            io_ns_per_elem=i,
            head_call_overhead_us=us,
        )
        for (c, d), (r, o, t, i) in TRUE_KERNELS.items()
    ]
    shape = ModelShape(heads=8, kv_heads=2, head_dim=64, layers=1)
    extra = {}
    for u in (8, 1):
        e0, e1 = (
            estimate(
                Cluster.preset("cpu", gpus_per_node=8).model_copy(
                    update={"calibration": cal.model_copy(update={"kernels": fits(us)})}
                ),
                shape,
                6144,
                u,
                8 // u,
                dtype="float32",
            )
            for us in (0.0, 1000.0)
        )
        assert e1.a2a_s == e0.a2a_s
        extra[u] = e1.attention_s - e0.attention_s
    within(relative_difference(extra[8], 2 * 1e-3), 1e-9, "extra u=8")
    within(relative_difference(extra[1], 2 * 8 * 8 * 1e-3), 1e-9, "extra u=1")


# ------------------------------------------------------------------------------------------------ ideal limit

# time_s, attention_s, ring_overhead_s, a2a_s, ring_exposed_s of the model before the calibrated terms
# (commit 2329d54), for presets that leave every new term at its ideal default.
GOLDEN = [
    (
        "dgx-h100",
        4,
        "llama3-8b",
        1 << 20,
        8,
        4,
        1,
        {},
        [2.0765470992892046, 1.9922394711573226, 0.004045979395820895, 0.0026217891555555552, 0.00537670912],
    ),
    (
        "dgx-h100",
        4,
        "llama3-8b",
        1 << 20,
        2,
        16,
        1,
        {},
        [2.0875665564100006, 1.9922394711573226, 0.01618391758328358, 0.001503308088888889, 0.00537670912],
    ),
    (
        "dgx-h200",
        1,
        "glm-4.5-air",
        65536,
        1,
        4,
        2,
        {},
        [0.23459487900101472, 0.186772450420999, 0.0036595191466666666, 0.0, 0.0003012616177777778],
    ),
    (
        "pcie-8gpu",
        1,
        None,
        32768,
        4,
        2,
        1,
        {"backward": False},
        [0.04150385552425972, 0.01840186824729707, 0.00044836148148148146, 0.0025265824, 0.0],
    ),
    (
        "dgx-a100",
        2,
        "llama2-7b",
        131072,
        8,
        2,
        1,
        {"layout": "contiguous"},
        [0.33600166382108143, 0.2691112375675524, 0.0014306801530161845, 0.0015778734933333334, 0.010745418239999999],
    ),
    (
        "cpu",
        4,
        None,
        16384,
        2,
        4,
        1,
        {"causal": False},
        [10.795673194581333, 6.413817828693333, 0.01783503872, 0.02117152, 0.0135217728],
    ),
]


@pytest.mark.parametrize("preset, nodes, model, n, u, r, dp, kw, want", GOLDEN)
def test_ideal_limit_recovers_previous_predictions(preset, nodes, model, n, u, r, dp, kw, want):
    shape = ModelShape.preset(model) if model else ModelShape(heads=32, kv_heads=8, head_dim=128, layers=1)
    base = Cluster.preset(preset, nodes=nodes)
    ideal = base.model_copy(
        update={
            "accelerator": base.accelerator.model_copy(update={"kernel_call_overhead_us": 0.0, "ring_overlap": 1.0}),
            "intra_node": base.intra_node.model_copy(update={"contention": 1.0}),
        }
    )
    for which, cluster in (("base", base), ("ideal", ideal)):
        e = estimate(cluster, shape, n, u, r, dp, **kw)
        got = [e.time_s, e.attention_s, e.ring_overhead_s, e.a2a_s, e.ring_exposed_s]
        for name, g, w in zip(("time_s", "attention_s", "ring_overhead_s", "a2a_s", "ring_exposed_s"), got, want):
            # the golden figures in fp64 (repr round-trips): round-off of reordered sums, worst 0
            within(relative_difference(g, w, floor=1e-3), 1e-12, f"{which} {name}")


def test_new_terms_only_add_time():
    base = Cluster.preset("dgx-h100", nodes=4)
    model = ModelShape.preset("llama3-8b")
    ref = estimate(base, model, 1 << 18, 2, 16)
    slow = base.model_copy(
        update={
            "accelerator": base.accelerator.model_copy(update={"kernel_call_overhead_us": 50.0, "ring_overlap": 0.5}),
            "inter_node": base.inter_node.model_copy(update={"contention": 2.0}),
        }
    )
    e = estimate(slow, model, 1 << 18, 2, 16)
    assert e.attention_s > ref.attention_s and e.ring_exposed_s > ref.ring_exposed_s and e.time_s > ref.time_s


def test_calibrated_model_prices_every_term():
    cal = _true_calibration().model_copy(
        update={
            "kernels": [
                KernelFit(
                    backend="sdpa",
                    dtype="float32",
                    causal=c,
                    direction=d,
                    tflops=r,
                    call_overhead_us=o,
                    causal_tile_tokens=t,
                    io_ns_per_elem=i,
                )
                for (c, d), (r, o, t, i) in TRUE_KERNELS.items()
            ],
            "step_overhead_us": TRUE_STEP_US,
            "call_overhead_us": TRUE_CALL_US,
            "copy_gb_s": TRUE_COPY,
        }
    )
    cluster = Cluster.preset("cpu", gpus_per_node=8).model_copy(update={"calibration": cal})
    shape = ModelShape(heads=8, kv_heads=2, head_dim=64, layers=1)
    times = {}
    for u in (8, 4, 2, 1):
        e = estimate(cluster, shape, 8192, u, 8 // u, dtype="float32")
        assert e.attention_s > 0 and e.ring_overhead_s > 0 and e.attention_time_s < e.time_s
        assert (e.a2a_s > 0) == (u > 1) and (e.ring_exposed_s > 0) == (u < 8)
        times[u] = e.attention_time_s
    # no-arithmetic part agrees with the calibration's own pricing of the engine
    known, nbytes = engine_known_s(cal, 2, 4, 8192, 8, 2, 64, 4)
    assert known > 0 and nbytes == sum(estimate(cluster, shape, 8192, 2, 4, dtype="float32").bytes_per_rank.values())
    # bf16 was not calibrated: priced with the fp32 fits, and said so
    e = estimate(cluster, shape, 8192, 2, 4)
    assert any("bfloat16 not calibrated" in n for n in e.notes)


# ------------------------------------------------------------------------------------------------ files and CLI


def test_calibrated_cluster_round_trips_and_plans(tmp_path, capsys):
    from hybrid_cp.cli.plan import main as plan_main

    cal = _true_calibration().model_copy(
        update={
            "kernels": [
                KernelFit(
                    backend="sdpa",
                    dtype="float32",
                    causal=c,
                    direction=d,
                    tflops=r,
                    call_overhead_us=o,
                    causal_tile_tokens=t,
                    io_ns_per_elem=i,
                )
                for (c, d), (r, o, t, i) in TRUE_KERNELS.items()
            ],
            "not_measured": ["rest of the layer"],
        }
    )
    cluster = Cluster.preset("cpu", gpus_per_node=8).model_copy(update={"calibration": cal})
    for name in ("c.yaml", "c.json"):
        path = cluster.save(tmp_path / name)
        assert Cluster.load(path) == cluster
    assert (
        plan_main(
            [
                "--cluster",
                str(tmp_path / "c.yaml"),
                "--heads",
                "8",
                "--kv-heads",
                "2",
                "--head-dim",
                "64",
                "--layers",
                "1",
                "--seq-len",
                "8K",
                "--dtype",
                "fp32",
                "--json",
                "--dp",
                "1",
            ]
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert len(data["plans"]) == 4 and data["chosen"]["ring_link"] in ("measured", "none")
    # presets stay usable without calibration
    assert Cluster.preset("dgx-h100").calibration is None


def test_bench_cli_errors_are_loud(capsys, monkeypatch):
    from hybrid_cp.cli.bench import main as bench_main
    from hybrid_cp.cli.calibrate import main as calibrate_main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert bench_main(["--ulysses", "2", "--ring", "2", "--seq-len", "64", "--heads", "2", "--head-dim", "8"]) == 2
    assert "not under torchrun: pass --nprocs N" in capsys.readouterr().err
    assert calibrate_main(["--out", "x.yaml", "--nprocs", "2", "--backend", "nccl"]) == 2
    assert "needs torchrun" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench_main(["--ulysses", "16", "--ring", "1", "--seq-len", "64", "--heads", "8", "--head-dim", "8"])
    assert "--ulysses=16 exceeds --heads=8" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ real, short


def test_end_to_end_calibrate_then_bench(pool8):
    """A tiny real calibration on the suite's 8 gloo ranks, then one bench case priced from it."""
    from hybrid_cp.cli.bench import format_bench, summarize
    from hybrid_cp.cli.calibrate import calibrated_cluster as _calibrated_cluster

    spec = CalibrationSpec(
        world=8,
        kernel_shapes=[(64, 64, 4, True), (256, 256, 2, True), (128, 64, 4, False), (256, 128, 2, False)],
        merge_tokens=[256, 1024],
        a2a_bytes=[1 << 10, 1 << 16],
        p2p_bytes=[1 << 10, 1 << 16],
        overlap_tokens=128,
        overlap_bytes=1 << 14,
        engine_heads=8,
        engine_kv_heads=2,
        engine_lengths=[128],
        kernel_passes=1,
        probe_passes=1,
        stages=["kernels", "merge", "p2p", "overlap", "engine"],
    )  # a2a: covered by the fake source
    res = pool8.run(measure.measure_rank, timeout=600, spec=spec.model_dump(), repeats=1)
    r0 = res[0]
    kinds = {s["kind"] for s in r0["samples"]}
    assert {"kernel", "merge", "p2p", "overlap", "engine", "probe"} <= kinds, [
        s for s in r0["samples"] if s["kind"] == "skip"
    ]
    cal = fit(r0["samples"], spec, backend=r0["backend"], device=r0["device"], kernel_names=r0["kernel_names"])
    assert cal.kernel == "sdpa" and cal.world == 8 and len(cal.kernels) == 4 and cal.probe_s > 0
    assert all(k.tflops > 0 for k in cal.kernels)
    # on a loaded machine a 2-size link fit can fail; then it must be said, not hidden
    assert cal.p2p is not None or any(x.startswith("ring p2p:") for x in cal.not_measured)
    assert cal.merge is not None or any(x.startswith("merge:") for x in cal.not_measured)
    assert any("a2a: not requested" in x for x in cal.not_measured)  # said, not hidden
    cluster = _calibrated_cluster(cal, 1, 8, "gloo")
    assert Cluster.from_yaml(cluster.to_yaml()) == cluster
    out = pool8.run(
        measure.bench_rank,
        timeout=600,
        ulysses=2,
        ring=4,
        seq_len=256,
        heads=8,
        kv_heads=2,
        head_dim=16,
        causal=True,
        repeats=2,
        warmup=1,
    )
    summary = summarize(out, 2, 4, 256, 8, 2, 16, True, "float32", 1, cluster)
    assert summary["load_factor"] > 0 and summary["predicted_load_adjusted_s"] > 0
    for key in ("measured_s", "predicted_s", "ulysses", "ring", "seq_len"):
        assert summary[key] is not None
    assert summary["bytes_per_rank"] == summary["predicted_bytes"]  # the engine's counter = the model's bytes
    assert 0 < summary["measured_min_s"] <= summary["measured_s"] and summary["predicted_s"] > 0
    assert "predicted (cluster file)" in format_bench(summary)
    json.dumps(summary)
