"""A rank that stalls during `CPTrainer.evaluate()` (tests/test_faults.py): run by torchrun on 4 gloo ranks.

    torchrun --standalone --nproc-per-node 4 tests/trainer_fault_case.py OUT WHERE TIMEOUT_S

Rank 2 sleeps twice the group timeout before its first evaluation step's model call (WHERE = "forward") or
before its first loss gather (WHERE = "gather"); every rank writes OUT/rank<r>.json with the error it ended in
and how long `evaluate()` took, then exits 0 (torchrun would otherwise kill the ranks still reporting).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

STALLED = 2


def main(out: str, where: str, timeout_s: float) -> None:
    from hf_cases import collator, model_for, rows, training_args

    from hybrid_cp.integrations.hf import CPTrainer

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    args = training_args(os.path.join(out, "work"), 1, 1, eval_batch=1, ddp_timeout=int(timeout_s))
    trainer = CPTrainer(
        model=model_for("llama"), args=args, ulysses=2, ring=2, eval_dataset=rows(8, 1), data_collator=collator("dense")
    )
    if rank == STALLED:
        name = {"forward": "prediction_step", "gather": "_gather_replicas"}[where]
        original = getattr(trainer, name)

        def stalled(*a, **kw):
            time.sleep(2 * timeout_s)
            return original(*a, **kw)

        setattr(trainer, name, stalled)
    t0 = time.monotonic()
    try:
        trainer.evaluate()
        kind, msg = "no error", ""
    except Exception as exc:  # noqa: BLE001 - the test asserts on the type
        kind, msg = type(exc).__name__, str(exc)[:600]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"kind": kind, "msg": msg, "secs": time.monotonic() - t0}, f)
    os._exit(0)  # no exit-time collective with peers that are gone


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]
    main(sys.argv[1], sys.argv[2], float(sys.argv[3]))
