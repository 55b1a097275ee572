"""The figures tests/test_hf_trainer.py bounds, per case: CPTrainer on 4 gloo ranks against the stock Trainer.

    python benchmarks/hf_trainer_figures.py OUT      # runs the test's torchrun and reference once into OUT

Prints, for each CP case, the relative errors the test asserts on (loss, grad norm, eval loss, weights: the largest
element and the largest tensor norm), so a tolerance's margin over what is seen can be read off. Reuses OUT if it
already holds a run.
"""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import test_hf_trainer as t  # noqa: E402


def run(out: str) -> None:
    script = os.path.join(t.HERE, "hf_cases.py")
    with open(os.path.join(out, "cp.log"), "w") as log:
        cp = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                               script, out, "cp", *t.CHECKS, *t.CP_CASES, *t.RESUME], env=t._env(), stdout=log,
                              stderr=subprocess.STDOUT)
        ref = subprocess.run([sys.executable, script, out, "ref", *t.REF_CASES], env=t._env(), capture_output=True)
        if cp.wait() or ref.returncode:
            raise SystemExit(f"a run failed (see {out}/cp.log): {ref.stderr[-2000:]!r}")


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    if not os.path.exists(os.path.join(out, "checks.pt")):
        run(out)
    for case in t.CP_CASES:
        model, kind, u, r = case.split(":")
        got = t._load(out, f"cp-{model}_{kind}_{u}_{r}")
        want = t._load(out, "ref-" + t._ref(case).rsplit(":", 1)[0].replace(":", "_") + f"_dp{t._dp(int(u), int(r))}")
        element = max((t._rel(got["weights"][k], want["weights"][k]), k) for k in want["weights"])
        norm = max(t._rel_norm(got["weights"][k], want["weights"][k]) for k in want["weights"])
        print(f"{case:26s} loss {t._rel(got['loss'], want['loss']):.2e}  grad_norm "
              f"{t._rel(got['grad_norm'], want['grad_norm']):.2e}  eval {t._rel(got['eval_loss'], want['eval_loss']):.2e}"
              f"  weights: element {element[0]:.2e} ({element[1]}), norm {norm:.2e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "hf_trainer_figures")
