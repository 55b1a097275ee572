"""The bad-input campaign: mistakes a new user makes and legal edge inputs, over every public entry point, each
run on 4 gloo ranks (tests/bad_input_cases.py) and graded.

A mistake must end in the expected typed error on EVERY rank, its message naming the argument; legal edge inputs
(non-contiguous views, one token per rank, odd lengths, bf16/fp16 on CPU, ...) must give the single-device result.
Nothing may hang (the pool's groups time out after a few seconds, so a case that leaves ranks waiting fails
instead of hanging), raise on some ranks only, or leak a raw torch/gloo/IndexError.

A case is one line: (entry point, what it tries, expected, code). Expected is "ok"; "warn word": every rank runs
and logs a warning naming `word` (legal, but most likely a mistake, which the package cannot be sure of); or
"Class word": every rank raises hcp.Class and its message contains `word`; "Class word | R: Class2 word2": rank R (the one whose own
input is bad) raises Class2 naming word2 instead. `python tests/test_bad_inputs.py` prints how every case ended.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import bad_input_cases
import pytest
import torch
from tolerance import within

from hybrid_cp.testing import WorkerPool

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 4
TIMEOUT_S = 6.0  # the campaign meshes' group timeout (bad_input_cases.TIMEOUT_S): a case that leaves ranks
# waiting in their collectives fails after it instead of hanging

Q = "q, k, v = qkv(32); ql, kl, vl = (hcp.shard(x, {m}) for x in (q, k, v)); "
QA = Q.format(m="A")
QM = Q.format(m="M")
CU = "cu = [0, 5, 17, 18, 32]; "
MK = "mk = hcp.AttnMask.shared_prefix(12, [9, 11]); "
QMK = MK + "q, k, v = qkv(32); ql, kl, vl = (hcp.shard(x, {m}, mask=mk) for x in (q, k, v)); "
LM = (
    "from hybrid_cp.integrations.transformers import apply_context_parallel; model = tiny(); "
    "ids = torch.arange(1, 33)[None]; "
)
CK = "model = torch.nn.Linear(4, 4).double(); opt = torch.optim.SGD(model.parameters(), lr=0.1); d = folder('{d}'); "
TR = (
    "from transformers import TrainingArguments; from hybrid_cp.integrations.hf import CPTrainer; "
    "args = TrainingArguments(folder('trainer'), use_cpu=True, report_to=[], {a}); "
)
TK = (
    "from hybrid_cp.engine.kernels import get_kernel\n"
    "class Bad:\n"
    "    name = 'bad_lse'\n"
    "    def __init__(self): self.inner = get_kernel('math', torch.device('cpu'), torch.float64, 8)\n"
    "    def __getattr__(self, item): return getattr(self.__dict__['inner'], item)\n"
    "    def forward(self, *a, **kw):\n"
    "        out, lse = self.inner.forward(*a, **kw); return out, lse[..., :1]\n"
)

CASES = [
    # ---- init_cp_mesh
    ("init_cp_mesh", "degrees that do not divide the world", "ConfigError ulysses", "hcp.init_cp_mesh(3, 1)"),
    ("init_cp_mesh", "a zero degree", "ConfigError ulysses", "hcp.init_cp_mesh(0, 4)"),
    ("init_cp_mesh", "a float degree", "ConfigError ulysses", "hcp.init_cp_mesh(2.0, 2)"),
    ("init_cp_mesh", "ring missing", "ConfigError ring=", "hcp.init_cp_mesh(2)"),
    ("init_cp_mesh", "an unknown layout", "ConfigError layout", "hcp.init_cp_mesh(2, 2, layout='zig')"),
    ("init_cp_mesh", "an unknown validate mode", "ConfigError validate", "hcp.init_cp_mesh(2, 2, validate='some')"),
    ("init_cp_mesh", "a timeout in seconds", "ConfigError timeout", "hcp.init_cp_mesh(2, 2, timeout=30)"),
    ("init_cp_mesh", "dp that does not fit", "ConfigError dp=", "hcp.init_cp_mesh(2, 2, dp=2)"),
    ("init_cp_mesh", "a device this machine lacks", "ConfigError device", "hcp.init_cp_mesh(2, 2, device='cuda')"),
    # ---- shard
    ("shard", "not a tensor", "InputTypeError shard", "hcp.shard([1, 2, 3], M)"),
    ("shard", "not a mesh", "InputTypeError cp", "hcp.shard(torch.zeros(1, 8), 'mesh')"),
    ("shard", "a 1-D tensor with the default dim=1", "ShapeError dim", "hcp.shard(torch.arange(32.), M)"),
    ("shard", "dim out of range", "ShapeError dim", "hcp.shard(torch.zeros(1, 32, 4, 8), M, dim=5)"),
    ("shard", "an empty sequence", "ShapeError dim", "hcp.shard(torch.zeros(1, 0, 4), M)"),
    (
        "shard",
        "cu_seqlens not ending at the length",
        "ShapeError cu_seqlens",
        "hcp.shard(torch.zeros(1, 32), M, cu_seqlens=[0, 5, 30])",
    ),
    (
        "shard",
        "cu_seqlens as a float tensor",
        "ShapeError cu_seqlens",
        "hcp.shard(torch.zeros(1, 32), M, cu_seqlens=torch.tensor([0., 5., 32.]))",
    ),
    (
        "shard",
        "cu_seqlens not starting at 0",
        "ConfigError cu_seqlens",
        "hcp.shard(torch.zeros(1, 32), M, cu_seqlens=[2, 5, 32])",
    ),
    (
        "shard",
        "cu_seqlens decreasing",
        "ConfigError cu_seqlens",
        "hcp.shard(torch.zeros(1, 32), M, cu_seqlens=[0, 9, 5, 32])",
    ),
    (
        "shard",
        "cu_seqlens as numpy ints (legal)",
        "ok",
        "x = torch.randn(1, 32); a = hcp.shard(x, M, cu_seqlens=[int(c) for c in np.array([0, 5, 32])]); "
        "assert torch.equal(a, hcp.shard(x, M, cu_seqlens=list(np.array([0, 5, 32]))))",
    ),
    (
        "shard",
        "a non-contiguous view (legal)",
        "ok",
        "x = torch.randn(1, 4, 32, 8); assert torch.equal(hcp.shard(x.transpose(1, 2), M), "
        "hcp.shard(x.transpose(1, 2).contiguous(), M))",
    ),
    (
        "shard",
        "a negative dim (legal)",
        "ok",
        "x = torch.randn(1, 32, 4, 8); assert torch.equal(hcp.shard(x, M, dim=-3), hcp.shard(x, M))",
    ),
    ("shard", "a destroyed mesh", "SetupError destroy", "hcp.shard(torch.zeros(1, 32), D)"),
    # ---- unshard
    (
        "unshard",
        "a shard of the wrong local length",
        "warn matches no row",
        "hcp.shard(torch.zeros(1, 32), M); hcp.unshard(torch.zeros(1, 6), M)",
    ),
    ("shard", "a mask of another length", "ShapeError mask", MK + "hcp.shard(torch.zeros(1, 30, 4), M, mask=mk)"),
    (
        "shard",
        "mask and cu_seqlens together",
        "ConfigError mask",
        MK + "hcp.shard(torch.zeros(1, 32, 4), M, cu_seqlens=[0, 32], mask=mk)",
    ),
    (
        "shard",
        "a list of slices instead of an AttnMask",
        "InputTypeError mask",
        "hcp.shard(torch.zeros(1, 32, 4), M, mask=[(0, 32, 0, 32, None, 0)])",
    ),
    (
        "AttnMask",
        "two slices sharing cells",
        "ConfigError share",
        "hcp.AttnMask.from_slices(8, [(0, 8, 0, 8, None, 0), (0, 4, 0, 4, None, None)])",
    ),
    (
        "AttnMask",
        "a slice outside the row",
        "ConfigError slices[0]",
        "hcp.AttnMask.from_slices(8, [(0, 9, 0, 8, None, 0)])",
    ),
    ("positions", "mask and seq_len disagree", "ConfigError seq_len", MK + "hcp.positions(31, M, mask=mk)"),
    (
        "unshard",
        "mask of another row than the shard",
        "ConfigError mask=",
        MK + "x = hcp.shard(torch.zeros(1, 32, 4), M); hcp.unshard(x, M, mask=mk)",
    ),
    ("unshard", "seq_len that does not match", "ShapeError seq_len", "hcp.unshard(torch.zeros(1, 8), M, seq_len=50)"),
    ("unshard", "dim out of range", "ShapeError dim", "hcp.unshard(torch.zeros(1, 8), M, dim=3, seq_len=32)"),
    ("unshard", "a destroyed mesh", "SetupError destroy", "hcp.unshard(torch.zeros(1, 8), D, seq_len=32)"),
    (
        "unshard",
        "one rank alone passes a bad seq_len",
        "InconsistentRanksError unshard | 2: ShapeError seq_len",
        "hcp.unshard(torch.zeros(1, 8), A, seq_len=32 if rank != 2 else 50)",
    ),
    (
        "unshard",
        "a packed shard without cu_seqlens",
        "ConfigError cu_seqlens",
        CU + "xl = hcp.shard(torch.randn(1, 32), M, cu_seqlens=cu); hcp.unshard(xl, M)",
    ),
    (
        "unshard",
        "an odd length (legal)",
        "ok",
        "x = torch.randn(2, 31, 3); assert torch.equal(hcp.unshard(hcp.shard(x, M), M, seq_len=31), x)",
    ),
    (
        "unshard",
        "one token per rank (legal)",
        "ok",
        "x = torch.randn(1, 4, 3); assert torch.equal(hcp.unshard(hcp.shard(x, C), C, seq_len=4), x)",
    ),
    (
        "unshard",
        "a packed row (legal)",
        "ok",
        CU + "x = torch.randn(1, 32, 2); assert torch.equal(hcp.unshard(hcp.shard(x, M, cu_seqlens=cu), M, "
        "cu_seqlens=cu), x)",
    ),
    # ---- positions
    ("positions", "seq_len 0", "ConfigError seq_len", "hcp.positions(0, M)"),
    ("positions", "seq_len a float", "ConfigError seq_len", "hcp.positions(32.5, M)"),
    ("positions", "seq_len a bool", "ConfigError seq_len", "hcp.positions(True, M)"),
    (
        "positions",
        "seq_len and cu_seqlens disagree",
        "ConfigError seq_len",
        "hcp.positions(10, M, cu_seqlens=[0, 5, 9])",
    ),
    ("positions", "a destroyed mesh", "SetupError destroy", "hcp.positions(32, D)"),
    # ---- attention: keywords
    ("attention", "causal as a string", "InputTypeError causal", QM + "hcp.attention(ql, kl, vl, M, causal='yes')"),
    (
        "attention",
        "a negative softmax_scale",
        "ConfigError softmax_scale",
        QM + "hcp.attention(ql, kl, vl, M, causal=True, softmax_scale=-1.0)",
    ),
    (
        "attention",
        "a NaN softmax_scale",
        "ConfigError softmax_scale",
        QM + "hcp.attention(ql, kl, vl, M, causal=True, softmax_scale=math.nan)",
    ),
    (
        "attention",
        "return_lse as a string",
        "InputTypeError return_lse",
        QM + "hcp.attention(ql, kl, vl, M, causal=True, return_lse='yes')",
    ),
    (
        "attention",
        "an unknown backend",
        "ConfigError backend",
        QM + "hcp.attention(ql, kl, vl, M, causal=True, backend='flash4')",
    ),
    (
        "attention",
        "seq_len and cu_seqlens together",
        "ConfigError cu_seqlens",
        QM + "hcp.attention(ql, kl, vl, M, causal=True, seq_len=32, cu_seqlens=[0, 32])",
    ),
    (
        "attention",
        "a negative window",
        "ConfigError window",
        QM + "hcp.attention(ql, kl, vl, M, causal=True, window=-1)",
    ),
    (
        "attention",
        "a one-sided non-causal window",
        "ConfigError window",
        QM + "hcp.attention(ql, kl, vl, M, causal=False, window=(3,))",
    ),
    ("attention", "head_chunks 0", "ConfigError head_chunks", QM + "hcp.attention(ql, kl, vl, M, head_chunks=0)"),
    (
        "attention",
        "sinks of the wrong shape",
        "ShapeError sinks",
        QM + "hcp.attention(ql, kl, vl, M, causal=True, sinks=torch.zeros(3, dtype=torch.float64))",
    ),
    ("attention", "a negative softcap", "ConfigError softcap", QM + "hcp.attention(ql, kl, vl, M, softcap=-1.0)"),
    ("attention", "chunk_size 0", "ConfigError chunk_size", QM + "hcp.attention(ql, kl, vl, M, chunk_size=0)"),
    (
        "attention",
        "integer tensors",
        "InputTypeError dtype",
        "x = torch.ones(1, 8, 4, 8, dtype=torch.int32); hcp.attention(x, x, x, M, seq_len=32)",
    ),
    (
        "attention",
        "q and k of different dtypes",
        "InputTypeError dtype",
        QM + "hcp.attention(ql.float(), kl, vl, M, causal=True)",
    ),
    ("attention", "a destroyed mesh", "SetupError destroy", QM + "hcp.attention(ql, kl, vl, D, causal=True)"),
    (
        "attention",
        "a kernel that returns a wrong lse shape",
        "ShapeError lse",
        TK + "F2 = fresh(2, 2); " + Q.format(m="F2") + "hcp.attention(ql, kl, vl, F2, causal=True, backend=Bad())",
    ),
    # ---- attention: provenance (what shapes alone cannot tell)
    (
        "attention",
        "q/k/v as [B, H, S, D]",
        "ShapeError [B, S, H, D]",
        "q = torch.randn(1, 4, 32, 8, dtype=torch.float64); ql = hcp.shard(q, M, dim=2); "
        "hcp.attention(ql, ql, ql, M, causal=True)",
    ),
    (
        "attention",
        "full tensors (forgot to shard)",
        "warn hcp.shard",
        "hcp.shard(torch.zeros(1, 32), M); q, k, v = qkv(32); hcp.attention(q, k, v, M, causal=True)",
    ),
    (
        "attention",
        "tensors sharded on another mesh and layout",
        "ShapeError mesh",
        Q.format(m="C") + "hcp.attention(ql, kl, vl, M, causal=True)",
    ),
    (
        "attention",
        "cu_seqlens given to shard but not attention",
        "ConfigError cu_seqlens",
        CU + "q, k, v = qkv(32); ql, kl, vl = (hcp.shard(x, M, cu_seqlens=cu) for x in (q, k, v)); "
        "hcp.attention(ql, kl, vl, M, causal=True)",
    ),
    (
        "attention",
        "cu_seqlens given to attention but not shard",
        "ConfigError cu_seqlens",
        CU + QM + "hcp.attention(ql, kl, vl, M, causal=True, cu_seqlens=cu)",
    ),
    (
        "attention",
        "mask with causal=True",
        "ConfigError causal",
        QMK.format(m="M") + "hcp.attention(ql, kl, vl, M, mask=mk, causal=True)",
    ),
    (
        "attention",
        "mask with cu_seqlens",
        "ConfigError cu_seqlens",
        QMK.format(m="M") + "hcp.attention(ql, kl, vl, M, mask=mk, cu_seqlens=[0, 32])",
    ),
    (
        "attention",
        "mask with chunk_size",
        "ConfigError chunk_size",
        QMK.format(m="M") + "hcp.attention(ql, kl, vl, M, mask=mk, chunk_size=8)",
    ),
    (
        "attention",
        "a mask that is not an AttnMask",
        "InputTypeError mask",
        QM + "hcp.attention(ql, kl, vl, M, mask=torch.ones(32, 32, dtype=torch.bool))",
    ),
    (
        "attention",
        "a mask with a one-sided window",
        "ConfigError window",
        QMK.format(m="M") + "hcp.attention(ql, kl, vl, M, mask=mk, window=(3,))",
    ),
    (
        "attention",
        "mask given to shard but not attention",
        "ConfigError mask=",
        QMK.format(m="M") + "hcp.attention(ql, kl, vl, M, causal=True)",
    ),
    (
        "attention",
        "mask given to attention but not shard",
        "ConfigError mask=",
        MK + QM + "hcp.attention(ql, kl, vl, M, mask=mk)",
    ),
    (
        "attention",
        "ranks disagree on the mask",
        "InconsistentRanksError mask",
        "mk = hcp.AttnMask.shared_prefix(12, [9, 11] if rank != 2 else [11, 9]); q, k, v = qkv(32); "
        "ql, kl, vl = (hcp.shard(x, A, mask=mk) for x in (q, k, v)); hcp.attention(ql, kl, vl, A, mask=mk)",
    ),
    (
        "attention",
        "a shared prefix with a window and sinks (legal)",
        "ok",
        QMK.format(m="M")
        + "hcp.attention(ql, kl, vl, M, mask=mk, window=5, sinks=torch.zeros(4, dtype=torch.float64))",
    ),
    (
        "attention",
        "ranks disagree on softmax_scale",
        "InconsistentRanksError softmax_scale",
        QA + "hcp.attention(ql, kl, vl, A, causal=True, softmax_scale=0.5 if rank == 3 else 0.25)",
    ),
    (
        "attention",
        "ranks disagree on causal",
        "InconsistentRanksError causal",
        QA + "hcp.attention(ql, kl, vl, A, causal=rank != 1)",
    ),
    (
        "attention",
        "a rank changes causal on its 3rd call (validate=True)",
        "CommTimeoutError timeout | 1: CommTimeoutError causal",
        "F1 = fresh(2, 2); q, k, v = qkv(32); ql, kl, vl = (hcp.shard(x, F1) for x in (q, k, v))\n"
        "for i in range(3): hcp.attention(ql, kl, vl, F1, causal=not (rank == 1 and i == 2))",
    ),
    # ---- attention: legal edge inputs, against fp64 attention on the same (rounded) inputs. Bounds: fp64 1e-10
    # (worst seen 5.8e-16 over 3 runs: round-off of another summation order); bf16 3e-2 and fp16 3e-3 (worst 2.1e-3
    # and 2.4e-4: the output rounded to 8 and 11 bits), >= 12x; the bf16 loss 1e-6 (computed in fp32: worst 8.3e-8, 12x)
    ("attention", "one token per rank (legal)", "ok", "attend(C, 4)"),
    ("attention", "an odd length (legal)", "ok", "attend(A, 31)"),
    ("attention", "bf16 on CPU (legal)", "ok", "attend(A, 32, dtype=torch.bfloat16, tol=3e-2)"),
    ("attention", "fp16 on CPU (legal)", "ok", "attend(A, 32, dtype=torch.float16, tol=3e-3)"),
    ("attention", "uneven GQA heads (legal)", "ok", "attend(A, 32, h=6, hkv=2)"),
    ("attention", "a packed row with a one-token document (legal)", "ok", CU + "attend(A, 32, cu=cu)"),
    ("attention", "a non-causal (left, right) window (legal)", "ok", "attend(A, 32, causal=False, window=(3, 5))"),
    ("attention", "cu_seqlens as numpy ints (legal)", "ok", "attend(A, 32, cu=list(np.array([0, 5, 17, 18, 32])))"),
    (
        "attention",
        "non-contiguous views with unit stride (legal)",
        "ok",
        "q, k, v = qkv(32, h=8); ql, kl, vl = (hcp.shard(x, A)[:, :, ::2] for x in (q, k, v)); "
        "out = hcp.unshard(hcp.attention(ql, kl, vl, A, causal=True), A, seq_len=32); "
        "near(out, ref(q[:, :, ::2], k[:, :, ::2], v[:, :, ::2]), 1e-10)",
    ),
    # ---- shard_batch
    ("shard_batch", "not a dict", "InputTypeError batch", "hcp.shard_batch(torch.zeros(1, 8), M)"),
    ("shard_batch", "float input_ids", "ConfigError input_ids", "hcp.shard_batch({'input_ids': torch.zeros(1, 8)}, M)"),
    (
        "shard_batch",
        "left padding",
        "ConfigError attention_mask",
        "hcp.shard_batch({'input_ids': torch.ones(1, 8, dtype=torch.long), "
        "'attention_mask': torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])}, M)",
    ),
    (
        "shard_batch",
        "labels of another length",
        "ShapeError labels",
        "hcp.shard_batch({'input_ids': torch.ones(1, 8, dtype=torch.long), "
        "'labels': torch.ones(1, 9, dtype=torch.long)}, M)",
    ),
    (
        "shard_batch",
        "a packed row with a mask",
        "ConfigError attention_mask",
        "hcp.shard_batch({'input_ids': torch.ones(1, 8, dtype=torch.long), 'attention_mask': torch.ones(1, 8), "
        "'position_ids': torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]])}, M)",
    ),
    (
        "shard_batch",
        "ignore_index a string",
        "ConfigError ignore_index",
        "hcp.shard_batch({'input_ids': torch.ones(1, 8, dtype=torch.long)}, M, ignore_index='x')",
    ),
    (
        "shard_batch",
        "a different batch on each rank",
        "InconsistentRanksError input_ids",
        "hcp.shard_batch({'input_ids': torch.arange(32)[None] + (rank == 2)}, M)",
    ),
    (
        "shard_batch",
        "an odd length (legal)",
        "ok",
        "ids = torch.arange(1, 32)[None]; out = hcp.shard_batch({'input_ids': ids}, M); "
        "assert torch.equal(hcp.unshard(out['input_ids'], M, seq_len=31), ids); "
        "assert torch.equal(hcp.unshard(out['labels'], M, seq_len=31)[0, :-1], ids[0, 1:])",
    ),
    # ---- cross_entropy
    (
        "cross_entropy",
        "one rank alone passes a bad reduction",
        "InconsistentRanksError cross_entropy | 1: ConfigError reduction",
        "hcp.cross_entropy(torch.randn(1, 8, 5), torch.zeros(1, 8, dtype=torch.long), A, "
        "reduction='avg' if rank == 1 else 'mean')",
    ),
    (
        "cross_entropy",
        "logits and labels of other shapes",
        "ShapeError labels",
        "hcp.cross_entropy(torch.randn(1, 8, 5), torch.zeros(1, 7, dtype=torch.long), M)",
    ),
    (
        "cross_entropy",
        "float labels",
        "InputTypeError labels",
        "hcp.cross_entropy(torch.randn(1, 8, 5), torch.zeros(1, 8), M)",
    ),
    (
        "cross_entropy",
        "labels outside the vocabulary",
        "ConfigError vocabulary",
        "hcp.cross_entropy(torch.randn(1, 8, 5), torch.full((1, 8), 7), M)",
    ),
    (
        "cross_entropy",
        "a destroyed mesh",
        "SetupError destroy",
        "hcp.cross_entropy(torch.randn(1, 8, 5), torch.zeros(1, 8, dtype=torch.long), D)",
    ),
    (
        "cross_entropy",
        "bf16 logits (legal)",
        "ok",
        "g = torch.Generator().manual_seed(1); x = torch.randn(1, 32, 11, generator=g).bfloat16(); "
        "y = torch.randint(0, 11, (1, 32), generator=g); "
        "loss = hcp.cross_entropy(hcp.shard(x, M), hcp.shard(y, M), M); "
        "near(loss, F.cross_entropy(x.float()[0], y[0]), 1e-6)",
    ),
    # ---- the tiled loss, MLP and norm
    (
        "tiled_cross_entropy",
        "reduction none",
        "ConfigError reduction",
        "hcp.tiled_cross_entropy(torch.randn(1, 8, 4), torch.randn(5, 4), torch.zeros(1, 8, dtype=torch.long), M, "
        "reduction='none')",
    ),
    (
        "tiled_cross_entropy",
        "chunk_tokens 0",
        "ConfigError chunk_tokens",
        "hcp.tiled_cross_entropy(torch.randn(1, 8, 4), torch.randn(5, 4), torch.zeros(1, 8, dtype=torch.long), M, "
        "chunk_tokens=0)",
    ),
    (
        "tiled_cross_entropy",
        "a weight of the wrong width",
        "ShapeError weight",
        "hcp.tiled_cross_entropy(torch.randn(1, 8, 4), torch.randn(5, 3), torch.zeros(1, 8, dtype=torch.long), M)",
    ),
    ("tile_mlp", "chunk_tokens 0", "ConfigError chunk_tokens", "hcp.tile_mlp(tiny(), chunk_tokens=0)"),
    ("tile_mlp", "a model without MLPs", "ConfigError mlp", "hcp.tile_mlp(torch.nn.Linear(2, 2))"),
    ("tile_norm", "chunk_tokens -1", "ConfigError chunk_tokens", "hcp.tile_norm(tiny(), chunk_tokens=-1)"),
    (
        "lm_loss",
        "a batch without labels",
        "ConfigError labels",
        "hcp.lm_loss(tiny(), {'input_ids': torch.ones(1, 8, dtype=torch.long)}, M)",
    ),
    (
        "tiled_cross_entropy",
        "one rank alone passes a bad reduction",
        "InconsistentRanksError tiled_cross_entropy | 1: ConfigError reduction",
        "hcp.tiled_cross_entropy(torch.randn(1, 8, 4), torch.randn(5, 4), torch.zeros(1, 8, dtype=torch.long), A, "
        "reduction='avg' if rank == 1 else 'mean')",
    ),
    (
        "tiled_cross_entropy",
        "ranks disagree on ignore_index",
        "InconsistentRanksError ignore_index",
        "hcp.tiled_cross_entropy(torch.randn(1, 8, 4), torch.randn(5, 4), torch.zeros(1, 8, dtype=torch.long), A, "
        "ignore_index=-1 if rank == 3 else -100)",
    ),
    (
        "lm_loss",
        "one rank alone passes a bad chunk_tokens",
        "InconsistentRanksError lm_loss | 2: ConfigError chunk_tokens",
        LM + "apply_context_parallel(model, A); b = hcp.shard_batch({'input_ids': ids}, A); "
        "hcp.lm_loss(model, b, A, chunk_tokens=0 if rank == 2 else None)",
    ),
    # ---- apply_context_parallel, a patched model, shard_model
    ("apply_context_parallel", "not a mesh", "InputTypeError cp", LM + "apply_context_parallel(model, 'mesh')"),
    (
        "apply_context_parallel",
        "head_chunks 0",
        "ConfigError head_chunks",
        LM + "apply_context_parallel(model, M, head_chunks=0)",
    ),
    (
        "apply_context_parallel",
        "a module that is not a transformers model",
        "InputTypeError PreTrainedModel",
        LM + "apply_context_parallel(torch.nn.Linear(2, 2), M)",
    ),
    (
        "apply_context_parallel",
        "the full batch without shard_batch",
        "warn shard_batch",
        LM + "apply_context_parallel(model, M); hcp.shard_batch({'input_ids': ids}, M); model(input_ids=ids)",
    ),
    (
        "apply_context_parallel",
        "labels without shift_labels",
        "ConfigError shift_labels",
        LM + "apply_context_parallel(model, M); b = hcp.shard_batch({'input_ids': ids}, M); "
        "model(input_ids=b['input_ids'], labels=b['labels'])",
    ),
    (
        "apply_context_parallel",
        "a model's attention code hands [B, S, H, D]",
        "ShapeError dim 2",
        LM + "from hybrid_cp.integrations.transformers import hybrid_cp_attention_forward as attend_hf; "
        "apply_context_parallel(model, M); x = torch.randn(1, 8, 4, 16, dtype=torch.float64); "
        "attend_hf(model.model.layers[0].self_attn, x, x, x, None)",
    ),
    (
        "shard_model",
        "mesh= given",
        "ConfigError mesh",
        "from hybrid_cp.integrations.fsdp import shard_model; shard_model(torch.nn.Linear(2, 2), M, mesh=None)",
    ),
    (
        "shard_model",
        "not a mesh",
        "InputTypeError cp",
        "from hybrid_cp.integrations.fsdp import shard_model; shard_model(torch.nn.Linear(2, 2), 'mesh')",
    ),
    # ---- checkpoints
    (
        "load_checkpoint",
        "a directory that does not exist",
        "ConfigError directory",
        CK.format(d="missing") + "hcp.load_checkpoint(d + '/nope', model, opt, M)",
    ),
    (
        "save_checkpoint",
        "keep 0",
        "ConfigError keep",
        CK.format(d="keep") + "hcp.save_checkpoint(d, 1, model, opt, M, keep=0)",
    ),
    (
        "save_checkpoint",
        "extra that JSON cannot hold",
        "ConfigError extra",
        CK.format(d="extra") + "hcp.save_checkpoint(d, 1, model, opt, M, extra={'x': object()})",
    ),
    (
        "save_checkpoint",
        "ranks at different steps",
        "InconsistentRanksError step",
        CK.format(d="steps") + "hcp.save_checkpoint(d, 1 + (rank == 3), model, opt, M)",
    ),
    (
        "save_checkpoint",
        "an unwritable directory",
        "SetupError writable",
        CK.format(d="file") + "os.makedirs(os.path.dirname(d), exist_ok=True); open(d, 'w').close() if rank == 0 "
        "else None; hcp.save_checkpoint(d + '/x', 1, model, opt, M)",
    ),
    (
        "load_checkpoint",
        "a checkpoint of another model shape",
        "ConfigError shape",
        CK.format(d="shape") + "hcp.save_checkpoint(d, 1, model, opt, M); other = torch.nn.Linear(4, 3).double(); "
        "hcp.load_checkpoint(d, other, torch.optim.SGD(other.parameters(), lr=0.1), M)",
    ),
    (
        "load_checkpoint",
        "another global batch",
        "ConfigError global_batch",
        CK.format(d="batch") + "hcp.save_checkpoint(d, 1, model, opt, M, global_batch=4); "
        "hcp.load_checkpoint(d, model, opt, M, global_batch=8)",
    ),
    (
        "save_checkpoint",
        "a full disk on rank 0 while publishing (the older one still loads)",
        "ok",
        "fault_save('publish')",
    ),
    (
        "save_checkpoint",
        "a full disk on rank 2 while writing its shard (the older one still loads)",
        "ok",
        "fault_save('shard')",
    ),
    ("replica_samples", "global_batch 0", "ConfigError global_batch", "hcp.replica_samples(1, 0, M)"),
    # ---- register_kernel
    ("register_kernel", "not a kernel", "InputTypeError kernel", "hcp.register_kernel('x', object())"),
    (
        "register_kernel",
        "a name taken",
        "ConfigError overwrite",
        "hcp.register_kernel('math', hcp.get_kernel('math', torch.device('cpu'), torch.float32, 8))",
    ),
    (
        "register_kernel",
        "a name that is not a string",
        "InputTypeError name",
        "hcp.register_kernel(3, hcp.get_kernel('math', torch.device('cpu'), torch.float32, 8))",
    ),
    # ---- the Trainer classes
    (
        "CPTrainer",
        "label smoothing",
        "ConfigError label_smoothing_factor",
        TR.format(a="label_smoothing_factor=0.1") + "CPTrainer(model=tiny(), args=args, ulysses=2, ring=2)",
    ),
    (
        "CPTrainer",
        "fsdp2 a string",
        "ConfigError fsdp2",
        TR.format(a="seed=0") + "CPTrainer(model=tiny(), args=args, ulysses=2, ring=2, fsdp2='yes')",
    ),
]

# `hybrid-cp` flags, in this process: argparse's exit status 2 and a message naming the flag
CLI = [
    ("plan", "a zero --seq-len", ["plan", "--preset", "h100", "--model", "llama3-8b", "--seq-len", "0"], "seq-len"),
    ("plan", "no --seq-len", ["plan", "--preset", "h100", "--model", "llama3-8b"], "seq-len"),
    ("demo", "a zero --ulysses", ["demo", "--ulysses", "0"], "ulysses"),
    ("demo", "a negative --steps", ["demo", "--steps", "-1"], "steps"),
    (
        "bench",
        "heads not a multiple of kv heads",
        [
            "bench",
            "--ulysses",
            "2",
            "--ring",
            "1",
            "--seq-len",
            "64",
            "--heads",
            "4",
            "--kv-heads",
            "3",
            "--head-dim",
            "8",
        ],
        "kv-heads",
    ),
    (
        "bench",
        "an unknown --dtype",
        [
            "bench",
            "--ulysses",
            "2",
            "--ring",
            "1",
            "--seq-len",
            "64",
            "--heads",
            "4",
            "--head-dim",
            "8",
            "--dtype",
            "int8",
        ],
        "dtype",
    ),
    ("attention-demo", "zero --heads", ["attention-demo", "--heads", "0"], "heads"),
    ("calibrate", "no --out", ["calibrate"], "out"),
]


def grade(expected: str, per_rank: list[dict]) -> str:
    """How a case ended: "as expected", or what went wrong (silent, partial, raw, unclear, slow, wrong)."""
    raised = [r["raised"] for r in per_rank]
    if expected.startswith("warn "):  # legal but most likely a mistake: every rank runs and warns naming `word`
        word = expected.split(" ", 1)[1]
        bad = [i for i, r in enumerate(per_rank) if r["raised"] or not any(word in m for m in r["warnings"])]
        return (
            f"not warned on ranks {bad}: {[(r['raised'], r['message'][:120]) for r in per_rank]}"
            if bad
            else "as expected"
        )
    if expected == "ok":
        bad = [(i, r["raised"], r["message"][:150]) for i, r in enumerate(per_rank) if r["raised"]]
        return f"wrong: {bad}" if bad else "as expected"
    if all(x is None for x in raised):
        return "silent: no rank raised"
    if any(x is None for x in raised):
        return f"partial: ranks raised {raised}"
    main, _, lone = expected.partition(" | ")
    for rank, r in enumerate(per_rank):
        want = lone.split(": ", 1)[1] if lone and int(lone.split(":")[0]) == rank else main
        cls, word = want.split(" ", 1)
        if not r.get("typed"):
            return f"raw: rank {rank} raised {r['raised']}: {r['message'][:200]}"
        if r["raised"] != cls or word.lower() not in r["message"].lower():
            return f"unclear: rank {rank} raised {r['raised']} (wanted {cls} naming {word!r}): {r['message'][:200]}"
    return "as expected"


def run_campaign(pool: WorkerPool, cases: list[tuple] = CASES) -> list[tuple[tuple, str, float, list]]:
    """(case, verdict, slowest rank's seconds, [(label, error, tol) of every `near`]) per case, in table order.
    Cases that end in a timeout run last: a group that timed out may leave gloo pairs behind that a later case
    on another group would trip over."""
    order = sorted(range(len(cases)), key=lambda i: "CommTimeoutError" in cases[i][2])
    per_rank = pool.run(bad_input_cases.run_cases, codes=[cases[i][3] for i in order], timeout=600)
    results = {}
    for j, i in enumerate(order):
        ends = [rank[j] for rank in per_rank]
        figures = [
            (f"rank {rank} near {j}", err, tol)
            for rank, r in enumerate(ends)
            for j, (err, tol) in enumerate(r.get("errors", []))
        ]
        worst = max((err for _, err, _ in figures), default=None)
        verdict = grade(cases[i][2], ends)
        results[i] = (
            cases[i],
            verdict
            + (
                f" (worst error {worst:.2g})"
                if worst is not None and verdict == "as expected" and sys.argv[0].endswith("test_bad_inputs.py")
                else ""
            ),
            max(r["seconds"] for r in ends),
            figures,
        )
    return [results[i] for i in range(len(cases))]


@pytest.fixture(scope="module")
def campaign():
    with WorkerPool(WORLD, extra_paths=[HERE]) as pool:
        try:
            yield run_campaign(pool)
        finally:
            shutil.rmtree(os.path.join(tempfile.gettempdir(), f"hybrid-cp-bad-inputs-{os.getpid()}"), True)


def test_the_campaign_covers_every_entry_point():
    entries = {c[0] for c in CASES}
    assert {
        "init_cp_mesh",
        "shard",
        "unshard",
        "positions",
        "attention",
        "shard_batch",
        "cross_entropy",
        "tiled_cross_entropy",
        "tile_mlp",
        "tile_norm",
        "apply_context_parallel",
        "shard_model",
        "save_checkpoint",
        "load_checkpoint",
        "register_kernel",
        "CPTrainer",
        "AttnMask",
    } <= entries
    assert len(CASES) + len(CLI) >= 60 and len({c[:2] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("i", range(len(CASES)), ids=[f"{c[0]}:{c[1]}" for c in CASES])
def test_bad_input(campaign, i):
    case, verdict, seconds, figures = campaign[i]
    assert verdict == "as expected", f"{case[0]}: {case[1]}: {verdict}"
    for label, err, tol in figures:  # the legal edge inputs' errors (asserted on the ranks too)
        within(err, tol, label)
    # a case that leaves ranks waiting ends in CommTimeoutError (a verdict other than "as expected" above)
    assert seconds < 3 * TIMEOUT_S, (case, seconds)


def test_head_layout_reads_the_heads_the_config_states(caplog):
    """[B, S, H, D] given to the attention function raises; a head count the config does not state warns once."""
    from hybrid_cp.errors import ShapeError
    from hybrid_cp.integrations.model_support import check_head_layout

    module = torch.nn.Module()
    module.config = type("Config", (), {"num_attention_heads": 4})()
    check_head_layout(module, torch.zeros(1, 4, 8, 16))  # [B, H, S, D]: silent
    with pytest.raises(ShapeError, match="dim 2"):
        check_head_layout(module, torch.zeros(1, 8, 4, 16))
    with caplog.at_level("WARNING", logger="hybrid_cp"):
        check_head_layout(module, torch.zeros(1, 3, 8, 16))
        check_head_layout(module, torch.zeros(1, 3, 8, 16))
    assert [r.getMessage().count("num_attention_heads=4") for r in caplog.records] == [1]


@pytest.mark.parametrize("command, what, argv, flag", CLI, ids=[f"{c[0]}:{c[1]}" for c in CLI])
def test_cli_flag(command, what, argv, flag, capsys):
    from hybrid_cp.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err


if __name__ == "__main__":  # the table: how every case ends now
    sys.path.insert(0, HERE)
    with WorkerPool(WORLD, extra_paths=[HERE]) as pool:
        chosen = [c for c in CASES if not sys.argv[1:] or any(word in c[1] for word in sys.argv[1:])]
        for (entry, what, expected, _), verdict, seconds, _ in run_campaign(pool, chosen):
            print(f"{entry:24s} {what:55s} {seconds:5.1f}s {verdict[:160]}")
