"""Train an EAGLE-3 draft head for a target model (SmolLM2-135M-Instruct by default).

    python -m oasiskv.train.eagle3 --out DIR --minutes 15 --device cuda      # the full run (H200)
    python -m oasiskv.train.eagle3 --out DIR --steps 5 --seq-len 128          # CPU smoke, < 60 s

What it trains (the EAGLE-3 recipe, at this project's conventions, see :mod:`oasiskv.models.eagle3`):

* the target is frozen; its hidden states ENTERING layers ``(2, L // 2, L - 3)`` (2, 15, 27 for
  SmolLM2) are computed batch by batch on the fly (nothing is cached on disk) and fused by ``fc``;
* one decoder layer over ``[norm(embedding of token p); norm(fc(feature of p - 1))]``, a final norm
  and an ``lm_head`` over a draft vocabulary: the ``--draft-vocab`` most frequent target tokens of
  the training corpus (``d2t``/``t2d`` map it to the target vocabulary); the token embedding is the
  target's (not saved with the head);
* the loss at each position is the cross-entropy between the head's distribution and the target's
  next-token distribution restricted to the draft vocabulary (soft labels);
* training-time test: after the first pass, the head's own output hidden states replace the
  target features for ``--ttt-steps - 1`` further passes, each one position further ahead (row r
  at pass k reads the token at r + 1 + k at RoPE position r + 1 + k and attends to the first
  pass's keys of positions <= r + 1 plus its own row's keys of passes 1..k, as drafting k tokens
  ahead would); pass k's loss is weighted by ``--ttt-decay ** k``;
* AdamW, linear warm-up then cosine decay, gradient clipping; on a GPU the target runs in bf16
  and the head under bf16 autocast.

Data: the train split of :mod:`oasiskv.eval.corpus` (installed Python sources and docs), in a
seeded order, packed into ``--seq-len`` windows; acceptance is measured on the held-out split.

Time budget: ``--minutes`` counts the training loop only, summed over invocations; the setup
(loading the target, listing the corpus, cutting the held-out windows, counting the draft
vocabulary, the held-out evaluation before training) and the evaluation and saving after it come on
top (the setup's phases are printed and recorded in ``training.json: setup_s``). Without
``--steps`` the number of steps is fixed once, at step 40 of the run: steps 10..40 are timed (the
first ten, with the allocator's and the kernels' warm-up, are left out) and the steps that fit the
rest of the budget, less a 3 % margin, are added. Nothing depends on the total before then: the
warm-up (``--warmup``, 100 steps) is not capped by it in this mode.

Determinism: the initialisation, the draft vocabulary and the data order are fixed by ``--seed``;
the learning-rate schedule by ``--steps`` and ``--warmup``. ``training.json: reproduce`` is the
command that repeats the run (every argument that affects the result, with the exact ``--steps``
and ``--warmup`` used). A run stopped by ``--stop-after-minutes`` saves ``train_state.pt`` and the
same command resumes it (so a 15-minute run fits in device calls of at most 10 minutes).

Outputs in ``--out``: ``config.json`` + ``model.safetensors`` (the head, public EAGLE-3 format,
``--save-dtype``), ``training.json`` (arguments, command, corpus fingerprint, loss curve,
held-out acceptance before/after) and ``train_log.jsonl`` (one line per logged step).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from ..eval import corpus
from ..models.eagle3 import Eagle3Head
from ..models.transformer import apply_rope, dense_causal_attn, rope_cos_sin

MAX_HEAD_BYTES = 25 * 1024 * 1024
DEFAULT_WARMUP = 100
# Without --steps: steps [TIME_FROM, TIME_TO) of an invocation are timed, the total is fixed at
# TIME_TO to fill MARGIN of the budget left.
TIME_FROM, TIME_TO, MARGIN = 10, 40, 0.97


# ------------------------------------------------------------------------------------------ data
class TokenStream:
    """Token windows ``[batch, seq_len]`` from the train split, resumable by a cursor.

    The stream is the files of :func:`corpus.train_files` in order, each followed by ``sep``, and
    starts over after the last file. ``cursor = (file index, token offset in that file's token
    list)`` of the next unread token; a stream made with that cursor continues identically.
    """

    def __init__(self, tokenizer, files, sep: int, cursor=(0, 0), files_per_read: int = 64) -> None:
        if not files:
            raise ValueError("the training corpus is empty")
        self.tok, self.files, self.sep = tokenizer, files, sep
        self.files_per_read = files_per_read
        self._segs: list[tuple[int, int, list[int]]] = []  # (file index, start offset, tokens)
        self._next_file, self._skip = int(cursor[0]), int(cursor[1])
        self.cursor: tuple[int, int] = (self._next_file, self._skip)
        self.epoch = 0

    def _fill(self, need: int) -> None:
        have = sum(len(t) for _, _, t in self._segs)
        while have < need:
            if self._next_file >= len(self.files):
                self._next_file = 0
                self.epoch += 1
            idx = list(range(self._next_file, min(len(self.files), self._next_file + self.files_per_read)))
            self._next_file = idx[-1] + 1
            texts = [corpus.read_text(self.files[i]) or "" for i in idx]
            for i, ids in zip(idx, corpus.encode_many(self.tok, texts), strict=True):
                ids = [*ids, self.sep]
                start, self._skip = self._skip, 0
                if ids[start:]:
                    self._segs.append((i, start, ids[start:]))
                    have += len(ids) - start

    def take(self, n: int) -> list[int]:
        self._fill(n)
        out: list[int] = []
        while len(out) < n:
            i, start, ids = self._segs[0]
            k = min(n - len(out), len(ids))
            out += ids[:k]
            if k == len(ids):
                self._segs.pop(0)
            else:
                self._segs[0] = (i, start + k, ids[k:])
        if self._segs:
            self.cursor = (self._segs[0][0], self._segs[0][1])
        else:
            self.cursor = (self._next_file % len(self.files), 0)
        return out

    def batch(self, batch: int, seq_len: int) -> torch.Tensor:
        return torch.tensor(self.take(batch * seq_len), dtype=torch.long).view(batch, seq_len)


def draft_vocab(
    tokenizer, files, sep: int, vocab_size: int, size: int, tokens: int, chunk: int = 1 << 20
) -> torch.Tensor:
    """The ``size`` most frequent token ids in the first ``tokens`` tokens of the stream, sorted."""
    stream = TokenStream(tokenizer, files, sep)
    counts = torch.zeros(vocab_size, dtype=torch.long)
    left = tokens
    while left > 0:  # in chunks: 20M tokens as one list of Python ints would take about 1 GB
        ids = torch.tensor(stream.take(min(left, chunk)))
        c = torch.bincount(ids, minlength=vocab_size)
        if c.numel() > counts.numel():
            counts = torch.cat([counts, counts.new_zeros(c.numel() - counts.numel())])
        counts[: c.numel()] += c
        left -= ids.numel()
    size = min(size, vocab_size)
    # Ties go to the lower id (deterministic).
    top = torch.topk(counts.double() + 1e-6 * (counts.numel() - torch.arange(counts.numel())), size).indices
    return top.sort().values


def split_corpus(source: str, seed: int):
    """``(train files in the order of corpus.train_files, held-out files, fingerprint of all)`` from
    one walk of the corpus (``corpus.train_files``, ``list_files(split=...)`` and the fingerprint's
    list would walk it three times)."""
    every = corpus.list_files(source=source)
    train = [f for f in every if f.split == "train"]
    train.sort(key=lambda f: hashlib.sha256(f"{seed}:{f.key}".encode()).hexdigest())  # = train_files
    return train, [f for f in every if f.split == "heldout"], corpus.fingerprint(every)


# ------------------------------------------------------------------------------------------ model
def new_head(target, sel: torch.Tensor, seed: int, device) -> Eagle3Head:
    """A head for ``target`` with draft vocabulary ``sel`` (sorted target ids), seeded init:
    default ``nn.Linear`` init, unit norms, ``lm_head``/``norm`` copied from the target's."""
    torch.manual_seed(seed)
    cfg = target.config.replace(num_hidden_layers=1)
    head = Eagle3Head(cfg, len(sel), dtype=torch.float32, device=device)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
        head.lm_head.weight.copy_(target.lm_head[sel.to(target.lm_head.device)].float())
        head.norm.weight.copy_(target.norm.weight.float())
        head.d2t.copy_((sel - torch.arange(len(sel))).to(device))
        head.t2d.zero_()
        head.t2d[sel.to(device)] = True
    return head.attach_target(target)


@torch.no_grad()
def target_pass(target, tokens: torch.Tensor, sel: torch.Tensor, full_argmax: bool = False):
    """Target features ``[B, T, 3H]``, next-token logits over the draft vocab ``[B, T, dv]``
    (float32) and, with ``full_argmax``, the target's greedy token ``[B, T]``."""
    b, t = tokens.shape
    L = target.config.num_hidden_layers
    layers = Eagle3Head.capture_layers(L)
    dev = target.device
    ids = tokens.to(dev).flatten()
    pos = torch.arange(t, device=dev).repeat(b)
    cu = [i * t for i in range(b + 1)]
    _, cap = target.forward(
        ids,
        pos,
        dense_causal_attn(cu, target.attn_scale),
        logits_rows=torch.zeros(0, dtype=torch.long, device=dev),
        capture_layers=(*layers, L),
    )
    feats = torch.cat([cap[i] for i in layers], dim=-1).view(b, t, -1)
    normed = target.norm(cap[L])
    z = F.linear(normed, target.lm_head[sel.to(dev)]).float().view(b, t, -1)
    greedy = None
    if full_argmax:
        greedy = torch.cat([F.linear(c, target.lm_head).argmax(-1) for c in normed.split(4096)]).view(b, t)
    return feats, z, greedy


def _ttt_mask(n: int, passes: int, device) -> torch.Tensor:
    causal = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=device)
    return torch.cat([causal] + [eye] * (passes - 1), dim=1)  # [n, passes * n]


def ttt_forward(
    head: Eagle3Head, feats: torch.Tensor, tokens: torch.Tensor, passes: int
) -> list[torch.Tensor]:
    """Draft-vocabulary logits of each training-time-test pass, ``[B, T - 1, dv]`` each.

    Row r of pass k stands for drafting position r + 2 + k: it reads the token at r + 1 + k (RoPE
    position r + 1 + k) and, for k = 0, the target feature of position r, else the head's own
    output of row r at pass k - 1. Pass 0 equals :meth:`Eagle3Head.forward_train` per sequence.
    """
    b, t = tokens.shape
    n = t - 1
    cfg = head.config
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ml, at = head.midlayer, head.midlayer.self_attn
    dev = head.fc.weight.device
    tokens = tokens.to(dev)
    h = head.fc(feats[:, :n].to(device=dev, dtype=head.fc.weight.dtype))
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs = []
    rows = torch.arange(n, device=dev)
    for k in range(passes):
        tok = tokens[:, (rows + 1 + k).clamp(max=t - 1)]
        pos = rows + 1 + k
        x = torch.cat([ml.input_layernorm(head.embed(tok)), ml.hidden_norm(h)], dim=-1)
        q = at.q_proj(x).view(b, n, hq, d)
        kk = at.k_proj(x).view(b, n, hkv, d)
        vv = at.v_proj(x).view(b, n, hkv, d)
        cos, sin = rope_cos_sin(head.inv_freq, pos, torch.float32, head.rope_attention_factor)
        q, kk = apply_rope(q, cos, sin).to(vv.dtype), apply_rope(kk, cos, sin).to(vv.dtype)
        ks.append(kk)
        vs.append(vv)
        kc = torch.cat(ks, dim=1).transpose(1, 2)  # [B, hkv, (k+1) n, d]
        vc = torch.cat(vs, dim=1).transpose(1, 2)
        if hq != hkv:
            kc = kc.repeat_interleave(hq // hkv, dim=1)
            vc = vc.repeat_interleave(hq // hkv, dim=1)
        if k == 0:
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, is_causal=True, scale=d**-0.5)
        else:
            mask = _ttt_mask(n, k + 1, dev)
            o = F.scaled_dot_product_attention(q.transpose(1, 2), kc, vc, attn_mask=mask, scale=d**-0.5)
        o = o.transpose(1, 2).reshape(b, n, hq * d)
        h = h + at.o_proj(o)
        h = h + ml.mlp(ml.post_attention_layernorm(h))
        outs.append(head.lm_head(head.norm(h)))
    return outs


def ttt_loss(outs: list[torch.Tensor], z: torch.Tensor, decay: float):
    """Weighted soft cross-entropy of every pass against the target's restricted distribution.

    Returns (loss, per-pass losses [passes], per-pass top-1 accuracies against the target's
    argmax [passes]), all tensors (reading them synchronises with the device)."""
    n = outs[0].shape[1]
    total = 0.0
    losses, accs = [], []
    for k, logits in enumerate(outs):
        m = n - k  # rows whose target position r + 1 + k exists
        if m <= 0:
            break
        tgt = z[:, 1 + k : 1 + k + m].to(logits.device)
        lp = torch.log_softmax(logits[:, :m].float(), dim=-1)
        loss = -(torch.softmax(tgt, dim=-1) * lp).sum(-1).mean()
        total = total + (decay**k) * loss
        losses.append(loss.detach())
        accs.append((lp.argmax(-1) == tgt.argmax(-1)).float().mean())
    return total, torch.stack(losses), torch.stack(accs)


@torch.no_grad()
def evaluate(
    head: Eagle3Head, target, windows: torch.Tensor, sel: torch.Tensor, passes: int, batch: int = 4
) -> dict:
    """Held-out acceptance: the head's greedy draft (pass 0, exactly the inference path of
    :meth:`Eagle3Head.step`) equals the target's greedy token of the same position; also the
    accuracy against the text itself, the pass-0 loss and the TTT passes' top-1 in the draft vocab."""
    was = head.training
    head.eval()
    acc = n = text_hits = n_text = covered = 0
    loss_sum = 0.0
    ttt_accs: list[float] = []
    for s in range(0, windows.shape[0], batch):
        tokens = windows[s : s + batch]
        feats, z, greedy = target_pass(target, tokens, sel, full_argmax=True)
        outs = ttt_forward(head, feats, tokens, passes)
        _, losses, accs = ttt_loss(outs, z, 1.0)
        loss_sum += float(losses[0]) * tokens.shape[0]
        ttt_accs.append(accs.tolist())
        covered += int(head.t2d[greedy[:, 1:].to(head.t2d.device)].sum())
        draft = head.to_target_ids(outs[0].argmax(-1))  # [B, T-1]: row r guesses the token at r + 2
        g = greedy[:, 1:].to(draft.device)  # the target's greedy guess for r + 2, made at r + 1
        acc += int((draft == g).sum())
        n += g.numel()
        text_hits += int((draft[:, :-1] == tokens[:, 2:].to(draft.device)).sum())
        n_text += draft[:, :-1].numel()
    head.train(was)
    return {
        "acceptance": acc / n,
        "accuracy_vs_text": text_hits / max(1, n_text),
        "draft_vocab_coverage": covered / n,
        "loss": loss_sum / windows.shape[0],
        "ttt_top1_draft_vocab": [
            sum(a[k] for a in ttt_accs) / len(ttt_accs) for k in range(len(ttt_accs[0]))
        ],
        "positions": n,
    }


# ------------------------------------------------------------------------------------------ main
def lr_at(step: int, total: int, base: float, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return base * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return base * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m oasiskv.train.eagle3",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--out", required=True, help="output directory of the head and its logs")
    ap.add_argument("--model", default="smollm2", help="target: 'smollm2', a .gguf or a HF directory")
    ap.add_argument("--device", default="auto", help="auto (cuda when available), cpu or cuda[:N]")
    ap.add_argument(
        "--minutes",
        type=float,
        default=15.0,
        help="wall-clock budget of the training loop, summed over invocations; the setup (loading, "
        "corpus listing, draft-vocabulary counting, held-out evaluation) and the final evaluation "
        "and saving come on top. The step count that fits is fixed at step 40 (steps 10..40 timed)",
    )
    ap.add_argument(
        "--stop-after-minutes",
        type=float,
        default=None,
        help="save state and stop this invocation after this much training-loop time",
    )
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps (default: what fits --minutes; replaces it)"
    )
    ap.add_argument(
        "--seq-len", type=int, default=None, help="tokens per sequence (default 2048 GPU, 128 CPU)"
    )
    ap.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 8 GPU, 2 CPU)")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"warm-up steps (default {DEFAULT_WARMUP}, capped at a tenth of --steps when --steps is given; "
        "a value given is used as is)",
    )
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--ttt-steps", type=int, default=4, help="training-time-test passes (1 = plain EAGLE)")
    ap.add_argument("--ttt-decay", type=float, default=0.8)
    ap.add_argument("--draft-vocab", type=int, default=8192)
    ap.add_argument("--vocab-tokens", type=int, default=None, help="tokens counted for the draft vocabulary")
    ap.add_argument("--eval-seqs", type=int, default=None, help="held-out windows for the acceptance rate")
    ap.add_argument("--source", default="all", choices=["all", "stdlib", "site"], help="corpus source")
    ap.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--checkpoint-minutes", type=float, default=4.0, help="save train_state.pt this often")
    ap.add_argument("--fresh", action="store_true", help="ignore an existing train_state.pt")
    ap.add_argument("--no-progress", action="store_true")
    return ap


# Arguments that do not change the trained head or the numbers in training.json; every other one
# is repeated by training.json's "reproduce" command (--minutes because --steps replaces it).
NOT_REPRODUCED = frozenset(
    {"out", "minutes", "stop_after_minutes", "threads", "log_every", "checkpoint_minutes"}
    | {"fresh", "no_progress"}
)


def reproduce_command(run_args: dict, parser: argparse.ArgumentParser | None = None) -> str:
    """The command that repeats a run: every argument of ``build_parser`` not in
    :data:`NOT_REPRODUCED`, with its value in ``run_args`` (the effective ones: exact ``--steps``
    and ``--warmup``, the device type, the device-dependent defaults filled in); ``--out DIR``."""
    parser = parser or build_parser()
    parts = ["python -m oasiskv.train.eagle3", "--out DIR"]
    for a in parser._actions:
        if not a.option_strings or a.dest in NOT_REPRODUCED or a.dest == "help":
            continue
        v = run_args[a.dest]
        flag = a.option_strings[0]
        if isinstance(a, argparse._StoreTrueAction):
            if v:
                parts.append(flag)
        elif v is not None:
            parts.append(f"{flag} {shlex.quote(repr(v) if isinstance(v, float) else str(v))}")
    return " ".join(parts)


def _defaults(args, cuda: bool) -> None:
    for name, gpu, cpu in (
        ("seq_len", 2048, 128),
        ("batch_size", 8, 2),
        ("vocab_tokens", 20_000_000, 200_000),
        ("eval_seqs", 32, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)


def _save_head(head: Eagle3Head, out: Path, dtype: torch.dtype) -> int:
    cfg = head.config
    # A fresh head in the save dtype: state_dict copies convert, the target embedding stays out.
    save = Eagle3Head(cfg, head.draft_vocab_size, head.target_hidden_size, dtype=dtype, device="cpu")
    save.load_state_dict({k: v.detach().cpu() for k, v in head.state_dict().items()})
    save.save(out)
    return (out / "model.safetensors").stat().st_size


def main(argv: list[str] | None = None) -> int:
    """``python -m oasiskv.train.eagle3``. Training turns TF32 matmuls on for its own run; the
    process-wide flags are restored after, so an in-process caller's float32 math is unchanged."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        return _main(argv)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _main(argv: list[str] | None) -> int:
    """The run, in named steps: :meth:`_Run.setup` (device, target, corpus, held-out windows),
    :meth:`_Run.start` (a fresh head, or the state an interrupted run saved), :meth:`_Run.train`
    (the step loop and its checkpoints) and :meth:`_Run.finish` (the held-out evaluation, the
    saved head, ``training.json``)."""
    run = _Run(build_parser().parse_args(argv))
    run.setup()
    run.start()
    if run.train():
        return 0  # stopped by --stop-after-minutes: the state is saved
    run.finish(argv)
    return 0


class _Run:
    """One invocation of the trainer: its arguments, device, target, corpus and head, and where
    the schedule stands (``step``, ``total``, ``warm``, ``elapsed``). :func:`_main` runs its
    steps in order; each step reads what the ones before it set."""

    def __init__(self, args) -> None:
        self.args = args
        self.t_start = time.perf_counter()
        self.setup_s: dict[str, float] = {}  # this invocation's setup, by phase (not counted in --minutes)

    def phase(self, name: str) -> None:
        """Record the setup phase that just ended (``training.json: setup_s``)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.setup_s[name] = round(now - self.t_phase, 2)
        self.t_phase = now

    def setup(self) -> None:
        """The device, the frozen target (and its bf16 copy on a GPU), the corpus split and the
        held-out windows."""
        from ..models.loader import load_model

        args = self.args
        if args.threads:
            torch.set_num_threads(args.threads)
        device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
        )  # training needs no OasisKV kernel: any CUDA device torch sees will do
        cuda = device.type == "cuda"
        self.device, self.cuda = device, cuda
        _defaults(args, cuda)
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.progress = not args.no_progress
        self.t_phase = time.perf_counter()
        target, tok = load_model(args.model, dtype=torch.float32, device=device)
        target.eval()
        # On a GPU the training passes read a bf16 copy of the target (as the engine serves it
        # there): the project's fused kernels take one dtype, so an f32 target under autocast is
        # refused.
        self.train_target = (
            load_model(args.model, dtype=torch.bfloat16, device=device)[0].eval() if cuda else target
        )
        self.target, self.tok = target, tok
        sep = tok.token_to_id("<|endoftext|>")
        if sep is None:
            sep = (tok.eos_token_ids or [0])[0]
        self.sep = sep
        self.phase("load")
        self.files, self.heldout, self.fp = split_corpus(args.source, args.seed)
        self.phase("corpus_listing")
        self.windows = torch.tensor(
            [
                w["tokens"]
                for w in corpus.heldout_texts(
                    tok, args.seq_len, args.eval_seqs, source=args.source, seed=args.seed, files=self.heldout
                )
            ]
        )
        self.phase("heldout_windows")

    def start(self) -> None:
        """The draft vocabulary, the head and its optimizer, and the schedule: fresh (then the
        held-out evaluation before training), or from ``train_state.pt`` of an interrupted run."""
        args, target = self.args, self.target
        self.state_path = self.out / "train_state.pt"
        state = None
        if self.state_path.is_file() and not args.fresh:
            state = torch.load(self.state_path, map_location="cpu", weights_only=False)
            print(f"resuming from {self.state_path} at step {state['step']}", file=sys.stderr)
        if state is not None:
            sel = state["sel"]
        else:
            sel = draft_vocab(
                self.tok, self.files, self.sep, target.config.vocab_size, args.draft_vocab, args.vocab_tokens
            )
            self.phase("draft_vocab")
        self.sel = sel
        self.head = head = new_head(target, sel, args.seed, self.device)
        self.opt = torch.optim.AdamW(
            head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, fused=self.cuda
        )
        self.log: list[dict] = []
        self.step, self.elapsed, self.total = 0, 0.0, args.steps
        # The warm-up is fixed before the first step (the schedule of the steps before the total is
        # known must not depend on it): a tenth of --steps at most when the default is left to it.
        if args.warmup is not None:
            self.warm = args.warmup
        elif args.steps is not None:
            self.warm = min(DEFAULT_WARMUP, max(1, args.steps // 10))
        else:
            self.warm = DEFAULT_WARMUP
        self.cursor = (0, 0)
        self.before = None
        if state is not None:
            head.load_state_dict(state["head"])
            self.opt.load_state_dict(state["opt"])
            self.step, self.elapsed, self.cursor = state["step"], state["elapsed_s"], tuple(state["cursor"])
            self.total = state["total_steps"] if args.steps is None else args.steps
            self.warm = state.get("warmup", self.warm)
            self.log, self.before = state["log"], state["eval_before"]
            torch.set_rng_state(state["rng"])
        else:
            self.before = evaluate(head, target, self.windows, sel, args.ttt_steps)
            print(f"held-out before training: {json.dumps(self.before)}", file=sys.stderr)
            self.phase("heldout_eval_before")
        self.setup_total = time.perf_counter() - self.t_start
        print(
            f"setup {self.setup_total:.1f} s "
            f"({', '.join(f'{k} {v:.1f} s' for k, v in self.setup_s.items())}); "
            "not counted in --minutes",
            file=sys.stderr,
        )

    def save_state(self, state_cursor) -> None:
        """Write ``train_state.pt`` (atomically): what a later invocation resumes from."""
        torch.save(
            {
                "step": self.step,
                "total_steps": self.total,
                "warmup": self.warm,
                "elapsed_s": self.elapsed + (time.perf_counter() - self.t_inv),
                "cursor": list(state_cursor),
                "sel": self.sel,
                "head": self.head.state_dict(),
                "opt": self.opt.state_dict(),
                "rng": torch.get_rng_state(),
                "log": self.log,
                "eval_before": self.before,
                "args": vars(self.args),
            },
            self.state_path.with_suffix(".tmp"),
        )
        os.replace(self.state_path.with_suffix(".tmp"), self.state_path)

    def train(self) -> bool:
        """The step loop: without ``--steps`` the total is fixed at step ``TIME_TO`` from the
        time of steps ``TIME_FROM..TIME_TO``; checkpoints every ``--checkpoint-minutes``. True
        where ``--stop-after-minutes`` stopped it (the state saved for the same command)."""
        args, head, opt, sel, cuda, device = self.args, self.head, self.opt, self.sel, self.cuda, self.device
        self.stream = stream = TokenStream(self.tok, self.files, self.sep, cursor=self.cursor)
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
        )
        budget_s = args.minutes * 60.0
        stop_s = args.stop_after_minutes * 60.0 if args.stop_after_minutes else math.inf
        self.t_inv = t_inv = time.perf_counter()
        last_ckpt = t_inv
        elapsed = self.elapsed
        step_inv = self.step  # this invocation's first step
        t_timed = None  # the time at step step_inv + TIME_FROM
        self.truncated = False  # the budget ran out mid-schedule (before the total, or before it was fixed)
        bar = None
        if self.progress:
            from tqdm import tqdm

            bar = tqdm(total=self.total, initial=self.step, desc="eagle3", unit="step")
        logf = (self.out / "train_log.jsonl").open("a", encoding="utf-8")
        stopped = False
        head.train()
        self.first_losses: list[float] = [r["loss"] for r in self.log[:10]]
        self.recent: list[torch.Tensor] = []
        tokens = stream.batch(args.batch_size, args.seq_len)
        state_cursor = self.cursor  # the stream position after the last batch trained on
        while self.total is None or self.step < self.total:
            step = self.step
            if self.total is None and step - step_inv in (TIME_FROM, TIME_TO):
                if cuda:
                    torch.cuda.synchronize(device)  # time finished steps, not queued ones
                if step - step_inv == TIME_FROM:
                    t_timed = time.perf_counter()
                else:
                    now = time.perf_counter()
                    per_step = (now - t_timed) / (TIME_TO - TIME_FROM)
                    left = budget_s - (elapsed + (now - t_inv))
                    self.total = max(step + 1, step + int(MARGIN * left / per_step))
                    print(
                        f"{per_step:.3f} s/step over steps {step_inv + TIME_FROM}..{step}: "
                        f"{self.total} steps in all",
                        file=sys.stderr,
                    )
                    if bar:
                        bar.total = self.total
                        bar.refresh()
            now = time.perf_counter()
            spent = elapsed + (now - t_inv)
            if args.steps is None and spent >= budget_s:
                self.truncated = True  # the estimate ran long, or the budget was spent before step TIME_TO
                self.total = step
                break
            if now - t_inv >= stop_s:
                stopped = True
                break
            lr = lr_at(step, self.total or 10**9, args.lr, self.warm, args.min_lr_ratio)
            for g in opt.param_groups:
                g["lr"] = lr
            feats, z, _ = target_pass(self.train_target, tokens, sel)
            with autocast:
                outs = ttt_forward(head, feats, tokens, args.ttt_steps)
                loss, losses, accs = ttt_loss(outs, z, args.ttt_decay)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(head.parameters(), args.grad_clip)
            opt.step()
            self.step = step = step + 1
            state_cursor = stream.cursor
            if self.total is None or step < self.total:
                tokens = stream.batch(args.batch_size, args.seq_len)  # CPU work while the device runs
            self.recent = [*self.recent[-9:], loss.detach()]
            if len(self.first_losses) < 10:
                self.first_losses.append(float(loss.detach()))
            if step % args.log_every == 0 or step == 1 or step == self.total:
                rec = {
                    "step": step,
                    "loss": float(loss.detach()),
                    "pass_losses": losses.tolist(),
                    "pass_top1": accs.tolist(),
                    "lr": lr,
                    "grad_norm": float(gn),
                    "elapsed_s": round(elapsed + time.perf_counter() - t_inv, 2),
                    "epoch": stream.epoch,
                }
                self.log.append(rec)
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
                if bar:
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", top1=f"{rec['pass_top1'][0]:.3f}")
            if bar:
                bar.update(1)
            if time.perf_counter() - last_ckpt >= args.checkpoint_minutes * 60:
                self.save_state(state_cursor)
                last_ckpt = time.perf_counter()
        if bar:
            bar.close()
        logf.close()
        if stopped:
            self.save_state(state_cursor)
            print(
                f"stopped at step {self.step}/{self.total} after --stop-after-minutes; state in "
                f"{self.state_path}: run the same command again to resume",
                file=sys.stderr,
            )
        return stopped

    def finish(self, argv: list[str] | None) -> None:
        """The held-out evaluation after training, the saved head (reloaded as users load it and
        evaluated again) and ``training.json``; ``train_state.pt`` goes."""
        args, target, device, sel, step, out = (
            self.args,
            self.target,
            self.device,
            self.sel,
            self.step,
            self.out,
        )
        train_s = self.elapsed + (time.perf_counter() - self.t_inv)
        t_finish = time.perf_counter()
        after = evaluate(self.head, target, self.windows, sel, args.ttt_steps)
        size = _save_head(self.head, out, getattr(torch, args.save_dtype))
        # The saved head, reloaded as users load it, drafts the same tokens (save dtype permitting).
        reloaded = Eagle3Head.load(out, target.config, dtype=torch.float32, device=device).attach_target(
            target
        )
        after_reloaded = evaluate(reloaded, target, self.windows, sel, 1)
        first = self.first_losses or [math.nan]
        last = [float(x) for x in self.recent] or [math.nan]
        run_args = {**vars(args), "steps": step, "warmup": self.warm, "device": device.type}
        summary = {
            "command": "python -m oasiskv.train.eagle3 "
            + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
            "reproduce": reproduce_command(run_args),
            # A run whose budget ran out before the step count it had fixed (or before it fixed
            # one) stopped mid-schedule: a run with --steps of that count decays its learning rate
            # to the end.
            "reproduce_exact": not self.truncated,
            "args": vars(args),
            "reproduce_args": {k: v for k, v in run_args.items() if k not in NOT_REPRODUCED},
            "target": args.model,
            "capture_layers": list(Eagle3Head.capture_layers(target.config.num_hidden_layers)),
            "draft_vocab": len(sel),
            "steps": step,
            "tokens_seen": step * args.batch_size * args.seq_len,
            "epochs_started": self.stream.epoch,
            "warmup_steps": self.warm,
            "train_s": train_s,
            "setup_s": {**self.setup_s, "total": round(self.setup_total, 2)},
            "finish_s": round(time.perf_counter() - t_finish, 2),
            "wall_s_this_invocation": time.perf_counter() - self.t_start,
            "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if self.cuda else ""),
            "torch": torch.__version__,
            "corpus_source": args.source,
            "corpus_fingerprint": self.fp,
            "train_files": len(self.files),
            "heldout_files": len(self.heldout),
            "heldout_windows": int(self.windows.shape[0]),
            "loss_first": sum(first) / len(first),
            "loss_last": sum(last) / len(last),
            "heldout_before": self.before,
            "heldout_after": after,
            "heldout_after_saved_head": after_reloaded,
            "acceptance": after_reloaded["acceptance"],
            "head_file_bytes": size,
            "head_within_25MB": size <= MAX_HEAD_BYTES,
        }
        (out / "training.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
        if self.state_path.is_file():
            self.state_path.unlink()
        print(
            f"trained {step} steps in {train_s / 60:.1f} min: loss {summary['loss_first']:.3f} -> "
            f"{summary['loss_last']:.3f}; "
            f"held-out acceptance {self.before['acceptance']:.3f} -> "
            f"{after_reloaded['acceptance']:.3f}; head "
            f"{size / 2**20:.1f} MiB in {out}",
            file=sys.stderr,
        )
        if size > MAX_HEAD_BYTES:
            print(
                f"warning: the head file is {size / 2**20:.1f} MiB > 25 MiB; lower --draft-vocab",
                file=sys.stderr,
            )


if __name__ == "__main__":
    sys.exit(main())
