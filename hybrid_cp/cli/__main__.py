"""``python -m hybrid_cp.cli COMMAND ...`` (what torchrun launches: ``torchrun ... -m hybrid_cp.cli calibrate``)."""

from hybrid_cp.cli import main

raise SystemExit(main())
