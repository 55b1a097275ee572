"""Training-side functions run on every rank of the worker pool: tiny transformers models under
context parallelism against the same model on one process. They return errors; the tests assert."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_cases import mesh

import hybrid_cp as hcp
from hybrid_cp.integrations.fsdp import average_gradients, shard_model
from hybrid_cp.integrations.transformers import apply_context_parallel
from hybrid_cp.testing.parity import replica_part, shared
from hybrid_cp.training.batch import shard_batch
from hybrid_cp.training.loss import cross_entropy

VOCAB = 256


def tiny_model(kind: str = "llama", hkv: int | None = 2, seed: int = 0, generic: bool = False, **overrides):
    """A tiny model of `kind`: the hand-made configurations below, or (`generic`, or any other model type)
    the family's default configuration made tiny by `hybrid_cp.testing.families` (`hkv=None`: its kv heads)."""
    import transformers

    from hybrid_cp.testing import families

    if generic:
        heads = {} if hkv is None else {"num_key_value_heads": hkv}
        return families.tiny_model(kind, seed=seed, **{**heads, **overrides})

    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=hkv,
        max_position_embeddings=1024,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**{"sliding_window": None, **common})
        cls = transformers.MistralForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "qwen3":
        config = transformers.Qwen3Config(**{"head_dim": 8, **common})
        cls = transformers.Qwen3ForCausalLM
    elif kind == "gemma3":  # alternating sliding-window and full layers
        layers = common["num_hidden_layers"]
        config = transformers.Gemma3TextConfig(
            **{
                "head_dim": 8,
                "sliding_window": 16,
                "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                **common,
            }
        )
        cls = transformers.Gemma3ForCausalLM
    else:
        return tiny_model(kind, hkv, seed, generic=True, **overrides)
    torch.manual_seed(seed)
    model = cls(config).float()
    model.train()
    return model


def make_batch(seed: int, b: int, s: int, pad: bool, learnable: bool = False):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s), generator=g)
    if learnable:  # arithmetic progressions mod VOCAB: a model can learn to predict them
        start = torch.randint(0, VOCAB, (b, 1), generator=g)
        step = torch.randint(1, 4, (b, 1), generator=g)
        ids = (start + step * torch.arange(s)) % VOCAB
    batch = {"input_ids": ids, "labels": ids.clone()}
    if pad:  # right padding: row i keeps s - 7*i tokens
        mask = torch.ones(b, s, dtype=torch.long)
        for i in range(b):
            mask[i, s - 7 * i :] = 0
        batch["attention_mask"] = mask
    return batch


def reference(model, batch):
    """Single-process run: logits, mean next-token loss over real tokens, parameter gradients."""
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    logits = model(input_ids=ids, attention_mask=mask).logits
    labels = ids[:, 1:].clone()
    if mask is not None:
        labels = labels.masked_fill(mask[:, 1:] == 0, -100)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), loss.detach(), grads


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def _full_grad(p):
    g = p.grad
    return g.full_tensor() if hasattr(g, "full_tensor") else g


def _grad_errors(grads: dict, ref_grads: dict, exclude: tuple = ()) -> tuple[float, str, float]:
    """(worst relative error, its parameter, worst error relative to the largest reference gradient); parameters
    whose name ends with one of `exclude` count only in the last (gradients that are zero in exact arithmetic:
    their relative error compares rounding with rounding)."""
    errs = {n: _rel(grads[n], ref_grads[n]) for n in ref_grads if n in grads and not n.endswith(tuple(exclude))}
    worst = max(errs, key=errs.get)
    scale = max(g.abs().max().item() for g in ref_grads.values())
    vs_largest = max((grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads if n in grads) / scale
    return errs[worst], worst, vs_largest


def model_parity(
    u: int,
    r: int,
    kind: str = "llama",
    hkv: int | None = 2,
    fsdp: bool = False,
    b: int = 2,
    s: int = 100,
    pad: bool = True,
    checkpoint: bool = False,
    config: dict | None = None,
    generic: bool = False,
    exclude: tuple = (),
    group: dist.ProcessGroup | None = None,
) -> dict:
    """logits / loss / every parameter gradient under CP vs one process (fp32); `config`
    overrides the tiny model's configuration (e.g. a sliding window); `generic` builds any family's
    default configuration made tiny; `exclude`: see `_grad_errors`. `group`: the ranks that run this call (one
    replica's cp group, see `family_runs`; None: every rank)."""
    cp = mesh(u, r)
    batch = make_batch(1234, b, s, pad)
    config = config or {}
    [(ref_logits, ref_loss, ref_grads)] = shared(
        [lambda: reference(tiny_model(kind, hkv, generic=generic, **config), batch)], group
    )

    model = apply_context_parallel(tiny_model(kind, hkv, generic=generic, **config), cp)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fsdp:
        shard_model(model, cp)
    local = shard_batch(batch, cp)
    logits = model(
        input_ids=local["input_ids"], position_ids=local["position_ids"], attention_mask=local.get("attention_mask")
    ).logits
    loss = cross_entropy(logits, local["labels"], cp)
    loss.backward()
    if not fsdp:
        average_gradients(model, group)
    full_logits = hcp.unshard(logits.detach(), cp, dim=1, seq_len=s)
    keep = batch["attention_mask"].bool() if pad else torch.ones(b, s, dtype=torch.bool)
    grads = {n: _full_grad(p) for n, p in model.named_parameters() if p.grad is not None}
    grad, worst, vs_largest = _grad_errors(grads, ref_grads, exclude)
    return {
        "logits": _rel(full_logits[keep], ref_logits[keep]),
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": grad,
        "worst_param": worst,
        "grad_vs_largest": vs_largest,
        "missing": sorted(set(ref_grads) ^ set(grads)),
    }


def family_runs(u: int, r: int, runs: list[dict]) -> dict:
    """Several parity runs in one pool task (one mesh): {name: model_parity(...) or, with packed=True,
    packed_model_parity(...)}, each run's other keys its arguments. Runs without FSDP are split over the mesh's
    replicas (each on one, `replica_part`): a rank returns its replica's and every FSDP run (FSDP2 shards over
    all ranks)."""
    cp = mesh(u, r)
    mine = set(replica_part(cp, range(len(runs))))
    out = {}
    for i, run in enumerate(runs):
        run = dict(run)
        name, packed = run.pop("name"), run.pop("packed", False)
        if run.get("fsdp"):
            out[name] = (packed_model_parity if packed else model_parity)(u, r, **run)
        elif i in mine:
            out[name] = (packed_model_parity if packed else model_parity)(u, r, **run, group=cp.cp_group)
    return out


def training_losses(u: int, r: int, steps: int = 20, fsdp: bool = False, s: int = 96, b: int = 2, hkv: int = 2) -> dict:
    """Per-step losses of AdamW training under CP and on one process, same seed and data."""
    cp = mesh(u, r)
    batches = [make_batch(100 + i, b, s, pad=i % 3 == 0, learnable=True) for i in range(steps)]

    ref_model = tiny_model("llama", hkv)
    opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    ref = []
    for batch in batches:
        opt.zero_grad()
        _, loss, _ = reference(ref_model, batch)
        opt.step()
        ref.append(loss.item())

    model = apply_context_parallel(tiny_model("llama", hkv), cp)
    if fsdp:
        shard_model(model, cp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    got = []
    for batch in batches:
        opt.zero_grad()
        local = shard_batch(batch, cp)
        logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        loss = cross_entropy(logits, local["labels"], cp)
        loss.backward()
        if not fsdp:
            average_gradients(model)
        opt.step()
        got.append(loss.item())
    return {"ref": ref, "cp": got}


def loss_parity(
    u: int, r: int, s: int = 37, b: int = 3, include_dp: bool = False, reduction: str = "mean", empty: bool = False
) -> dict:
    """hcp.cross_entropy on shards vs F.cross_entropy on the full sequence (value and logit gradient).

    Each dp replica gets its own data, so include_dp=True is checked against the mean over all of them.
    """
    cp = mesh(u, r)
    world = dist.get_world_size()
    dp = world // cp.size
    ignore = -7

    def data(d):
        g = torch.Generator().manual_seed(50 + d)
        logits = torch.randn(b, s, VOCAB, generator=g, dtype=torch.float64)
        ids = torch.randint(0, VOCAB, (b, s), generator=g)
        mask = torch.ones(b, s, dtype=torch.long)
        mask[1, s // 3 :] = 0  # right padding
        mask[2, 2:] = 0  # nearly empty row: only token 0 has a target
        if empty:
            mask[:] = 0
        return logits, {"input_ids": ids, "labels": ids, "attention_mask": mask}

    # reference: F.cross_entropy over the full sequences (of every dp replica if include_dp)
    fulls, targets = [], []
    for d in range(dp if include_dp else 1):
        logits, batch = data(d if include_dp else cp.dp_rank)
        labels = batch["labels"][:, 1:].masked_fill(batch["attention_mask"][:, 1:] == 0, ignore)
        fulls.append(logits.float().requires_grad_())
        targets.append(labels)
    ref_sum = sum(
        F.cross_entropy(x[:, :-1].reshape(-1, VOCAB), t.reshape(-1), ignore_index=ignore, reduction="sum")
        for x, t in zip(fulls, targets)
    )
    count = sum(int((t != ignore).sum()) for t in targets)
    ref = ref_sum / max(count, 1) if reduction == "mean" else ref_sum
    ref.backward()
    mine = fulls[cp.dp_rank if include_dp else 0]

    logits, batch = data(cp.dp_rank)
    local = shard_batch(batch, cp, ignore_index=ignore)
    local_logits = hcp.shard(logits.float(), cp, dim=1).requires_grad_()
    loss = cross_entropy(
        local_logits, local["labels"], cp, ignore_index=ignore, reduction=reduction, include_dp=include_dp
    )
    loss.backward()
    w = cp.size * (dp if include_dp else 1)
    ref_grad = hcp.shard(mine.grad, cp, dim=1)
    valid_here = int((local["labels"] != ignore).sum())
    scale = max(ref_grad.abs().max().item(), 1e-30)
    return {
        "loss": loss.item(),
        "ref": ref.item(),
        "grad": (local_logits.grad / w - ref_grad).abs().max().item() / scale,
        "grad_zero": local_logits.grad.abs().max().item() if valid_here == 0 else None,
        "valid_here": valid_here,
        "finite": bool(torch.isfinite(loss).item()),
    }


def error_messages(u: int, r: int) -> dict:
    """Unsupported configurations raise ValueError on every rank (no hang); returns the messages."""
    cp = mesh(u, r, validate="always")  # one case breaks rank 0's mask only
    out = {}
    batch = make_batch(7, 2, 40, pad=False)
    local = shard_batch(batch, cp)

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)

    model = apply_context_parallel(tiny_model("llama"), cp)
    attempt("labels", lambda: model(input_ids=local["input_ids"], labels=local["labels"]))
    bad_mask = torch.ones_like(local["input_ids"])
    if cp.rank == 0:
        bad_mask[0, 0] = 0  # a hole at the start of the sequence: left padding
    attempt("left_padding", lambda: model(input_ids=local["input_ids"], attention_mask=bad_mask))
    attempt(
        "mask_4d",
        lambda: model(input_ids=local["input_ids"], attention_mask=torch.ones(2, 1, local["input_ids"].shape[1], 40)),
    )
    attempt(
        "positions",
        lambda: model(input_ids=local["input_ids"], position_ids=torch.arange(local["input_ids"].shape[1])[None]),
    )
    # options reaching the attention call that it does not implement, or a softcap / s_aux that is not the
    # module's own (a Llama's eager attention ignores them): refused there, whatever their name
    attempt("softcap_runtime", lambda: model(input_ids=local["input_ids"], softcap=50.0))
    attempt("sinks_runtime", lambda: model(input_ids=local["input_ids"], s_aux=torch.zeros(4)))
    attempt("unknown_runtime", lambda: model(input_ids=local["input_ids"], attention_temperature=2.0))
    attempt("dropout", lambda: apply_context_parallel(tiny_model("llama", attention_dropout=0.1), cp))
    drop = apply_context_parallel(tiny_model("llama"), cp)
    drop.config.attention_dropout = 0.1
    for m in drop.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    attempt("dropout_runtime", lambda: drop(input_ids=local["input_ids"]))
    # and a correct call still works afterwards (nothing left half-done in the process groups)
    logits = model(input_ids=local["input_ids"]).logits
    out["ok_after"] = tuple(logits.shape)
    return out


_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_to_all_single",
    "all_to_all",
    "broadcast",
    "barrier",
    "reduce_scatter_tensor",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


def guard_on_every_rank(model_types: list[str]) -> dict:
    """apply_context_parallel on refused families with every collective of torch.distributed replaced by a
    counter: each family must raise the guard's error here, having started none. Then the guard on a
    Llama already wrapped by FSDP2 (its classes are FSDP subclasses of the model's own)."""
    from hybrid_cp.errors import ConfigError
    from hybrid_cp.integrations.model_support import check_model

    cp = mesh(2, 2)
    out = {"collectives": 0}
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def counted(*args, **kwargs):
        out["collectives"] += 1
        raise RuntimeError("a collective was started")

    try:
        for name in _COLLECTIVES:
            setattr(dist, name, counted)
        for model_type in model_types:
            try:
                apply_context_parallel(tiny_model(model_type, generic=True), cp)
                out[model_type] = "accepted"
            except ConfigError as exc:
                out[model_type] = str(exc)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    model = tiny_model("llama", generic=True)
    shard_model(model, cp)
    check_model(model)
    out["after_fsdp"] = "accepted"
    return out


# ---- packed documents (DataCollatorWithFlattening-style rows) ---------------------------------------------------

PACKED_DOC_LENS = (9, 1, 23, 4, 61, 2, 14)  # uneven, a length-1 document, one longer than the rest


def packed_row(seed: int, doc_lens=PACKED_DOC_LENS) -> dict:
    """One packed row as transformers' DataCollatorWithFlattening builds it: the documents' ids
    concatenated into [1, total], position ids restarting at 0 per document, and labels = ids with
    -100 at every document's first token (so no target crosses into the next document)."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in doc_lens]
    ids = torch.cat(docs)[None]
    labels = torch.cat([torch.cat([torch.tensor([-100]), d[1:]]) for d in docs if len(d)])[None]
    pos = torch.cat([torch.arange(n) for n in doc_lens])[None]
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def packed_reference(model, batch: dict, doc_lens=PACKED_DOC_LENS):
    """Single process, one document at a time (positions 0..len-1, labels shifted inside the document):
    the token-loss sum over all documents divided by the number of valid targets, and the gradients."""
    total, count, start = 0.0, 0, 0
    for n in doc_lens:
        if n == 0:  # an empty document (repeated boundary in cu_seq_lens_q) has no tokens to run
            continue
        ids = batch["input_ids"][:, start : start + n]
        labels = batch["labels"][0, start + 1 : start + n]
        logits = model(input_ids=ids, position_ids=torch.arange(n)[None]).logits
        total = total + F.cross_entropy(logits[0, :-1].reshape(-1, VOCAB), labels, ignore_index=-100, reduction="sum")
        count += int((labels != -100).sum())
        start += n
    loss = total / count
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def packed_model_parity(
    u: int,
    r: int,
    kind: str = "llama",
    hkv: int | None = 2,
    fsdp: bool = False,
    explicit_cu: bool = False,
    tiled_loss: bool = False,
    checkpoint: bool = False,
    doc_lens: tuple = PACKED_DOC_LENS,
    head_chunks: int = 1,
    exclude: tuple = (),
    group: dist.ProcessGroup | None = None,
) -> dict:
    """Loss and every parameter gradient of one packed-row step under CP vs the per-document reference
    (`tiled_loss`: through `hcp.lm_loss` on the shard_batch dict instead of logits + cross_entropy). `group`: see
    `model_parity`."""
    cp = mesh(u, r)
    batch = packed_row(4321, doc_lens)

    def ref():
        loss, grads = packed_reference(tiny_model(kind, hkv), batch, doc_lens)
        return loss, grads, _leak(kind, hkv, grads) if doc_lens == PACKED_DOC_LENS else None

    [(ref_loss, ref_grads, leak)] = shared([ref], group)
    if explicit_cu:  # the other accepted form: boundaries instead of restarting positions
        cu = torch.tensor([0] + list(torch.tensor(doc_lens).cumsum(0)), dtype=torch.int32)
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"], "cu_seq_lens_q": cu}

    model = apply_context_parallel(tiny_model(kind, hkv), cp, head_chunks=head_chunks)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fsdp:
        shard_model(model, cp)
    local = shard_batch(batch, cp)
    if tiled_loss:
        loss = hcp.lm_loss(model, local, cp, chunk_tokens=8)
    else:
        logits = model(
            input_ids=local["input_ids"],
            position_ids=local["position_ids"],
            cu_seq_lens_q=local["cu_seq_lens_q"],
            cu_seq_lens_k=local["cu_seq_lens_k"],
            max_length_q=local["max_length_q"],
            max_length_k=local["max_length_k"],
        ).logits
        loss = cross_entropy(logits, local["labels"], cp)
    loss.backward()
    if not fsdp:
        average_gradients(model, group)
    grads = {n: _full_grad(p) for n, p in model.named_parameters() if p.grad is not None}
    grad, worst, vs_largest = _grad_errors(grads, ref_grads, exclude)
    return {
        "loss": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad": grad,
        "grad_vs_largest": vs_largest,
        "worst_param": worst,
        "missing": sorted(set(ref_grads) ^ set(grads)),
        "cp_loss": loss.item(),
        "ref_loss": ref_loss.item(),
        "leak": leak,
    }


_LEAKS: dict = {}


def _leak(kind: str, hkv: int, ref_grads: dict) -> float:
    """How far the reference's gradients are from one dense causal pass over the whole packed row
    (attention crossing the documents): the test asserts this is large, i.e. it would catch a leak."""
    from hybrid_cp.training.batch import shift_labels

    if (kind, hkv) not in _LEAKS:
        batch = packed_row(4321)
        model = tiny_model(kind, hkv)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        labels = shift_labels(batch["labels"])
        F.cross_entropy(logits[0], labels[0], ignore_index=-100).backward()
        _LEAKS[kind, hkv] = max(_rel(p.grad, ref_grads[n]) for n, p in model.named_parameters() if p.grad is not None)
    return _LEAKS[kind, hkv]


def packed_labels(u: int, r: int, explicit_cu: bool = False) -> dict:
    """shard_batch of a packed row, then unshard of every returned per-token tensor (with cu_seqlens)."""
    cp = mesh(u, r)
    batch = packed_row(99)
    cu = [0] + torch.tensor(PACKED_DOC_LENS).cumsum(0).tolist()
    if explicit_cu:
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"], "cu_seq_lens_q": cu}
    local = shard_batch(batch, cp, ignore_index=-7)
    full = {k: hcp.unshard(local[k], cp, dim=1, cu_seqlens=cu) for k in ("input_ids", "labels", "position_ids")}
    return {
        "full": full,
        "local_len": local["input_ids"].shape[1],
        "cu_q": local["cu_seq_lens_q"].tolist(),
        "cu_k": local["cu_seq_lens_k"].tolist(),
        "cu_dtype": str(local["cu_seq_lens_q"].dtype),
        "max_q": local["max_length_q"],
        "max_k": local["max_length_k"],
    }
