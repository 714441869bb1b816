"""Lookahead sources: where the draft token of the next position comes from.

At decode step t a request feeds its current token x_t (position p) and, stacked beside it, a draft
token d_{t+1} for position p+1. The draft row's query at each layer ranks the block summaries and
predicts the blocks step t+1 will attend to. Every drafter answers one question: given the tokens
so far (ending with x_t), which token is at p+1?

* :class:`NgramDrafter` — prompt lookup: the token that followed the latest earlier occurrence of
  the longest matching suffix n-gram.
* :class:`Eagle3Drafter` — an EAGLE-3 head over the target's captured hidden states; by default
  its head first runs over the prompt's features, which the engine captures during the prefill.
* :class:`OracleDrafter` — the true next token (known from a reference run); measurement only.
  With ``force=True`` it also forces the speculative verdicts (:meth:`Drafter.forced_verdicts`):
  a benchmark mode whose tokens are not the model's.
* :class:`PreviousQueryDrafter` — no lookahead row at all: the current query predicts the next
  step (the FreeKV-like baseline the paper compares against).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .errors import ConfigError


class Drafter:
    """Interface of a lookahead source. Subclasses override :meth:`propose`.

    Lifecycle of a request: :meth:`begin`, then (only when :attr:`wants_prompt_features`) one
    :meth:`feed_prompt` per prefill chunk, then one :meth:`propose` per decode step, then :meth:`end`.
    The engine asks for a step's drafts of all its requests at once (:meth:`propose_batch`, which
    calls :meth:`propose` for each unless overridden). A speculative engine also asks, before each
    decode step, whether the drafter forces the verdicts of its drafts (:meth:`forced_verdicts`;
    none do but a measurement oracle).
    """

    name = "drafter"
    #: False when the drafter adds no lookahead row (the current query predicts the next step).
    uses_lookahead_row = True
    #: True when the engine should hand the drafter the captured hidden states of EVERY prompt
    #: position at prefill (:meth:`feed_prompt`); needs non-empty :meth:`capture_layers`.
    wants_prompt_features = False
    #: True when the drafter can report its probability of each draft: once
    #: :attr:`track_confidence` is set, it keeps ``last_confidence`` (request id -> the
    #: probability of its latest draft) up to date with every proposal. The engine sets it for
    #: ``KvConfig.lookahead_min_confidence``, the evaluation to bin the lookahead's accuracy.
    reports_confidence = False
    #: Set True (only on a drafter that :attr:`reports_confidence`) to keep ``last_confidence``.
    track_confidence = False

    def capture_layers(self, num_layers: int) -> tuple[int, ...]:
        """Target layers whose entering residual stream the drafter needs (none by default)."""
        return ()

    def begin(self, req_id: int, prompt: Sequence[int]) -> None:
        """A request starts."""

    def device_bytes(self, tokens: int) -> int:
        """Device memory the drafter keeps for one request of ``tokens`` positions (prompt and new
        tokens) while it runs, beside the engine's KV pools: 0 by default (a drafter without
        per-request device state)."""
        return 0

    def reserve(self, sizes: Sequence[int]) -> None:
        """Make room now, in one allocation, for requests of these many positions each beside the
        running ones (``LLMEngine.reserve_pools``), instead of growing as they arrive. Nothing by
        default."""

    def feed_prompt(self, req_id: int, prompt: Sequence[int], features: torch.Tensor, start: int = 0) -> None:
        """The engine prefilled ``prompt[start : start + n]``; ``features`` ``[n, width]`` are those
        positions' captured hidden states (:meth:`capture_layers` concatenated in order, the model's
        dtype and device), taken from the prefill forward itself.

        Called after :meth:`begin` and before the first :meth:`propose`, once per prefill chunk in
        position order (the chunks cover the whole prompt; today's engine prefills in one chunk,
        ``start = 0``, ``n = len(prompt)``). Only called when :attr:`wants_prompt_features`.
        """

    def end(self, req_id: int) -> None:
        """A request finished; drop its state."""

    def propose(self, req_id: int, tokens: Sequence[int], features: torch.Tensor | None = None) -> int:
        """The draft for the position after ``tokens[-1]``.

        ``features`` are the target's captured hidden states of the position before ``tokens[-1]``
        (``[3 * hidden]``), for drafters that ask for them.
        """
        raise NotImplementedError

    def propose_batch(
        self,
        req_ids: Sequence[int],
        tokens_list: Sequence[Sequence[int]],
        features_list: Sequence[torch.Tensor | None],
    ) -> list[int]:
        """One decode step's drafts for several requests: ``propose`` of each, in order (the
        default). A drafter with a model overrides it to run that model once for all of them."""
        return [self.propose(i, t, f) for i, t, f in zip(req_ids, tokens_list, features_list, strict=True)]

    def launch_batch(
        self,
        req_ids: Sequence[int],
        positions: Sequence[int] | torch.Tensor,
        token_ids: torch.Tensor,
        features: torch.Tensor,
    ) -> bool:
        """Start the next drafts on the device before the host has read the step's tokens: for
        request ``req_ids[j]``, its new token is ``token_ids[j]`` (a device tensor ``[n]``, the
        step's own output), at position ``positions[j]`` (a list, or a device tensor where a
        speculative step decides it), after the captured ``features[j]`` (``[n, width]``). True
        when the drafter queued its work: the engine's :meth:`propose_batch` of this step (for
        these requests, with the same tokens once read, or fewer requests where some finished)
        then only reads the drafts back. False (the default): nothing queued,
        :meth:`propose_batch` does the work.

        Why: a model drafter (EAGLE-3) launched this way queues its kernels behind the step's own
        while the GPU still runs it, instead of between the step's host read and the next step,
        where the GPU waits for it."""
        return False

    def forced_verdicts(
        self, req_ids: Sequence[int], tokens_list: Sequence[Sequence[int]]
    ) -> list[bool | None] | None:
        """Measurement only: the verdicts a speculative step must give the current drafts (those
        proposed after ``tokens_list[j][-1]``), one per request: True accepts the draft whatever
        the target's logits say (the draft is emitted as the first token and row 1's token as the
        second, the draft's K/V stored as for a genuine acceptance), False rejects it (row 0's
        token is emitted, nothing of the draft kept, even where the draft equals it), None leaves
        it to the engine's verification. ``None`` (the default, every real drafter): the engine
        verifies every draft itself.

        The engine asks once per speculative decode step (``LLMEngine(speculative=True)``), after
        the drafts and before the step, and applies a verdict to greedy rows that verify their
        draft only; it reaches the step as a per-row device input (eager and CUDA graph alike).
        Outputs under forced verdicts are NOT the model's greedy outputs: use it to measure what
        an acceptance rate buys (:class:`OracleDrafter` with ``force=True``), never to serve.
        """
        return None


class _NgramIndex:
    """One request's n-gram index: for each ``n``, the latest start of every n-gram whose follower
    exists, over the tokens seen so far. Appending a token indexes the n-grams it completes as
    followers: O(max_n) per token, where a scan of the window was O(window) per step."""

    __slots__ = ("src", "seen", "last", "latest")

    def __init__(self, src, max_n: int) -> None:
        self.src = src  # the token list indexed (the request's own, appended to in place)
        self.seen = 0  # tokens indexed
        self.last = None  # src[seen - 1], to notice a list that changed under us
        self.latest: list[dict] = [{} for _ in range(max_n + 1)]  # [n][gram] -> latest start

    def extend(self, toks: Sequence[int], max_n: int, min_n: int, start: int) -> None:
        """Index ``toks[self.seen:]``; positions before ``start`` only as n-gram context."""
        latest = self.latest
        for j in range(max(self.seen, start + 1), len(toks)):
            # toks[j] is the follower of the n-grams ending at j - 1.
            for n in range(min_n, max_n + 1):
                b = j - n
                if b < start:
                    break
                latest[n][toks[j - 1] if n == 1 else tuple(toks[b:j])] = b
        self.seen = len(toks)
        self.last = toks[-1] if toks else None


class NgramDrafter(Drafter):
    """Prompt-lookup drafting: match the longest suffix n-gram (``max_n`` down to ``min_n``) against
    earlier text within the last ``window`` tokens and propose the token that followed its latest
    occurrence. Without a match it proposes the current token again (a weak but harmless draft).

    Each request keeps an incremental index (:class:`_NgramIndex`), so a step costs O(max_n)
    lookups instead of a scan of the window (which took milliseconds per request at 16K tokens,
    on the host, between two GPU steps)."""

    name = "ngram"

    def __init__(self, max_n: int = 4, min_n: int = 1, window: int = 8192) -> None:
        if not 1 <= min_n <= max_n:
            raise ConfigError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if window < 2:
            raise ConfigError(f"window must be >= 2 tokens, got {window}")
        self.max_n, self.min_n, self.window = max_n, min_n, window
        self.hits = 0
        self.misses = 0
        self._index: dict = {}

    def end(self, req_id) -> None:
        self._index.pop(req_id, None)

    def propose(self, req_id, tokens, features=None) -> int:
        n_tok = len(tokens)
        lo = max(0, n_tok - self.window)  # earliest start the window allows
        ix = self._index.get(req_id)
        if (
            ix is None
            or ix.src is not tokens
            or ix.seen > n_tok
            or (ix.seen and tokens[ix.seen - 1] != ix.last)
        ):
            # A new request, or a list that is not the one indexed (or changed other than by
            # appending): index it afresh, from the window's start.
            ix = self._index[req_id] = _NgramIndex(tokens, self.max_n)
            ix.extend(tokens, self.max_n, self.min_n, lo)
        else:
            ix.extend(tokens, self.max_n, self.min_n, 0)
        for n in range(min(self.max_n, n_tok - 1), self.min_n - 1, -1):
            key = tokens[-1] if n == 1 else tuple(tokens[n_tok - n :])
            start = ix.latest[n].get(key)
            # The latest occurrence with a follower; if it lies before the window, so do all.
            if start is not None and start >= lo:
                self.hits += 1
                return tokens[start + n]
        self.misses += 1
        return tokens[-1]


#: splitmix64's constants (Steele, Lea, Flood 2014): a fast, well-mixed 64-bit hash.
_MASK64 = (1 << 64) - 1


def _mix64(x: int) -> int:
    """splitmix64's step: a 64-bit hash of ``x`` whose bits look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


class OracleDrafter(Drafter):
    """The true next token, read from reference continuations (one list of generated tokens per
    prompt, e.g. from a greedy run); measurement only. Continuation ``k`` belongs to request
    ``first_id + k`` (the engine numbers its requests 0, 1, ... in the order they were added).

    ``accept`` (default 1) sets how often the draft is right: at each position the drafter drafts
    the reference token with probability ``accept``, otherwise a wrong token (uniform over the
    vocabulary without the reference token when ``vocab_size`` is given, else the reference token
    plus or minus one). The draw is a hash of ``(seed, k, position)``, so it does not depend on
    the batch, on the order of calls or on how many tokens a step made. With speculative decoding
    a greedy target then accepts a fraction ``accept`` of its drafts -- the curve a real head of
    that acceptance rate would follow, on random weights where no real head exists -- as long as
    the request's tokens follow the reference. A request that leaves it has no right drafts from
    there on; :attr:`off_reference` counts those. NOTE: with a working set smaller than the
    context the drafts steer the selection (the lookahead query, and the positions a step skips
    after an acceptance), so the tokens depend on them: a reference from a run without speculation
    or with another drafter is left within a few tokens, and the engine then accepts far fewer
    drafts than ``accept``. Two ways out: iterate to a reference the run reproduces
    (:meth:`set_reference` between rounds), or force the verdicts.

    ``force=True`` (measurement only) forces the verdicts (:meth:`forced_verdicts`): the draft of
    generated token ``i`` of request ``k`` is accepted exactly when the same draw says "reference"
    (:meth:`hit`), whatever the target's logits say, and rejected otherwise. So a fraction
    ``accept`` of the verified drafts is accepted, exactly, independent of the model: a hit does
    the work of a genuine acceptance (the draft's K/V stored with write-through and summary
    update, the tables advanced by two tokens, row 1's token emitted after the draft), a miss that
    of a rejection. The tokens are then NOT the model's greedy outputs (a hit emits the drafted
    reference token, which need not be the argmax); on random weights, where tokens mean nothing,
    this measures the throughput at a set acceptance rate. The draw decides past the reference
    too (where the draft is the current token again). Sampling rows keep the engine's
    speculative-sampling rule. ``oasiskv.bench.fig11`` uses it by default
    (``--draft-verdicts forced``).

    ``shadow``: a drafter (an :class:`Eagle3Drafter` of the target's shape) run beside the oracle
    at every hook -- its features captured, its prompt prefilled, one draft per step -- whose
    drafts are thrown away. The oracle then costs what that drafter costs, so a speedup measured
    with it is not flattered by a draft that costs nothing.
    """

    name = "oracle"

    def __init__(
        self,
        continuations: Sequence[Sequence[int]],
        *,
        accept: float = 1.0,
        seed: int = 0,
        vocab_size: int | None = None,
        shadow: Drafter | None = None,
        first_id: int = 0,
        force: bool = False,
    ) -> None:
        if isinstance(accept, bool) or not isinstance(accept, int | float) or not 0.0 <= accept <= 1.0:
            raise ConfigError(f"accept must be a number in [0, 1], got {accept!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError(f"seed must be an int, got {seed!r}")
        if vocab_size is not None and (
            isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2
        ):
            raise ConfigError(f"vocab_size must be None or an int >= 2, got {vocab_size!r}")
        if shadow is not None and (not isinstance(shadow, Drafter) or not shadow.uses_lookahead_row):
            raise ConfigError(
                f"shadow must be a Drafter with a lookahead row (e.g. an Eagle3Drafter), got {shadow!r}"
            )
        if not isinstance(force, bool):
            raise ConfigError(f"force must be True or False, got {force!r}")
        self.accept = float(accept)
        #: Force the speculative verdicts (:meth:`forced_verdicts`); measurement only.
        self.force = force
        self.seed = seed
        self.vocab_size = vocab_size
        self.shadow = shadow
        self.wants_prompt_features = bool(shadow is not None and shadow.wants_prompt_features)
        self._prompt_len: dict[int, int] = {}
        self._checked: dict[int, int] = {}  # generated tokens compared with the reference so far
        self.set_reference(continuations, first_id)

    def set_reference(self, continuations: Sequence[Sequence[int]], first_id: int = 0) -> None:
        """Draft from these continuations for requests ``first_id, first_id + 1, ...`` from now
        on; the counters start again."""
        if isinstance(first_id, bool) or not isinstance(first_id, int) or first_id < 0:
            raise ConfigError(f"first_id must be an int >= 0, got {first_id!r}")
        self.continuations = [list(c) for c in continuations]
        self.first_id = first_id
        #: Drafts proposed from the reference, and how many of them were the reference token.
        self.drafts = 0
        self.reference_drafts = 0
        #: Requests whose generated tokens left their reference continuation.
        self.off_reference: set[int] = set()

    def capture_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.shadow.capture_layers(num_layers) if self.shadow is not None else ()

    def begin(self, req_id, prompt) -> None:
        k = req_id - self.first_id
        if not 0 <= k < len(self.continuations):
            raise ConfigError(
                f"OracleDrafter has continuations for requests {self.first_id}.."
                f"{self.first_id + len(self.continuations) - 1} but request {req_id} started; "
                "pass one continuation per prompt (set_reference(continuations, first_id) for later ones)"
            )
        self._prompt_len[req_id] = len(prompt)
        self._checked[req_id] = 0
        if self.shadow is not None:
            self.shadow.begin(req_id, prompt)

    def feed_prompt(self, req_id, prompt, features, start=0) -> None:
        if self.shadow is not None:
            self.shadow.feed_prompt(req_id, prompt, features, start)

    def end(self, req_id) -> None:
        self._prompt_len.pop(req_id, None)
        self._checked.pop(req_id, None)
        if self.shadow is not None:
            self.shadow.end(req_id)

    def propose(self, req_id, tokens, features=None) -> int:
        if self.shadow is not None:
            self.shadow.propose(req_id, tokens, features)  # its cost, not its draft
        return self._oracle(req_id, tokens)

    def propose_batch(self, req_ids, tokens_list, features_list) -> list[int]:
        if self.shadow is not None:
            self.shadow.propose_batch(req_ids, tokens_list, features_list)  # its cost, not its drafts
        return [self._oracle(i, t) for i, t in zip(req_ids, tokens_list, strict=True)]

    def launch_batch(self, req_ids, positions, token_ids, features) -> bool:
        # The shadow's cost, launched as it would be (its drafts are read back and discarded).
        return self.shadow is not None and self.shadow.launch_batch(req_ids, positions, token_ids, features)

    def forced_verdicts(self, req_ids, tokens_list) -> list[bool | None] | None:
        """With ``force``: per request, :meth:`hit` of the token its current draft is for (the
        next generated one); None without ``force`` (the engine verifies)."""
        if not self.force:
            return None
        return [
            self.hit(rid, len(toks) - self._prompt_len[rid])
            for rid, toks in zip(req_ids, tokens_list, strict=True)
        ]

    def hit(self, req_id: int, index: int) -> bool:
        """The draw of generated token ``index`` (0: the first after the prompt) of request
        ``req_id``: True (probability ``accept``) when the drafter drafts the reference token there
        and, with ``force``, the engine accepts the draft. A hash of ``(seed, req_id - first_id,
        index)``: it depends on nothing else."""
        return (
            self.accept >= 1.0 or (self._hash(req_id - self.first_id, index) >> 11) * 2.0**-53 < self.accept
        )

    def _hash(self, k: int, i: int) -> int:
        return _mix64(_mix64(_mix64(self.seed & _MASK64) ^ k) ^ i)

    def _oracle(self, req_id, tokens) -> int:
        k = req_id - self.first_id
        cont = self.continuations[k]
        i = len(tokens) - self._prompt_len[req_id]  # index of the next generated token
        if req_id not in self.off_reference:
            # The tokens generated since the last call (one, or two after an accepted draft).
            start, stop, p0 = self._checked.get(req_id, 0), min(i, len(cont)), len(tokens) - i
            if start < stop and list(tokens[p0 + start : p0 + stop]) != cont[start:stop]:
                self.off_reference.add(req_id)
            self._checked[req_id] = max(start, stop)
        if not 0 <= i < len(cont):
            return tokens[-1]
        truth = cont[i]
        self.drafts += 1
        if self.hit(req_id, i):
            self.reference_drafts += 1
            return truth
        h = self._hash(k, i)
        if self.vocab_size is not None:
            w = _mix64(h) % (self.vocab_size - 1)
            return w if w < truth else w + 1
        return truth - 1 if truth > 0 else truth + 1


class PreviousQueryDrafter(Drafter):
    """No lookahead: step t's own query selects the blocks of step t+1."""

    name = "previous-query"
    uses_lookahead_row = False

    def propose(self, req_id, tokens, features=None) -> int:  # pragma: no cover - never called
        raise RuntimeError("PreviousQueryDrafter adds no lookahead row")


class Eagle3Drafter(Drafter):
    """An EAGLE-3 head (see :mod:`oasiskv.models.eagle3`) drafting one token per step.

    With ``prefill=True`` (the default) the head's KV cache is filled over the prompt before the
    first draft, as EAGLE deployments do: the engine hands over the target features of every
    prompt position captured during its prefill forward (no second target pass), and
    :meth:`feed_prompt` runs the head over them with the training-time pairing -- row ``p`` pairs
    the feature of position ``p - 1`` with the token at ``p`` (RoPE position ``p``), for
    ``p = 1 .. P - 1``. The first :meth:`propose` (feature of ``P - 1``, first generated token at
    ``P``) then attends over the whole prompt, exactly like row ``P - 1`` of
    :func:`oasiskv.train.eagle3.ttt_forward`'s first pass. ``prefill=False`` keeps the head's
    cache empty until decoding starts (it sees only positions drafted since then).

    ``paged`` (default: on a GPU): the requests' head caches share one
    :class:`~oasiskv.models.eagle3.Eagle3PagedKV`, so a batched step attends over all of them in
    one decode-attention call instead of one SDPA call per request; False keeps a contiguous
    cache per request (the CPU default: there the per-request attention is as fast).
    """

    name = "eagle3"
    reports_confidence = True

    def __init__(self, head, target, *, prefill: bool = True, paged: bool | None = None) -> None:
        from .models.eagle3 import Eagle3State  # local: keeps `import oasiskv` light

        self.head = head
        self.target = target
        if head.embed_tokens is None:
            head.attach_target(target)  # the public format shares the target's token embedding
        self._state_cls = Eagle3State
        self._states: dict[int, object] = {}
        p = next(head.parameters())
        self.paged = p.device.type == "cuda" if paged is None else bool(paged)
        self._pool = None  # the Eagle3PagedKV, made with the first paged state
        # (request -> row, drafts, logits) of the head step launch_batch queued, until read.
        self._launched = None
        self.wants_prompt_features = bool(prefill)
        self.name = "eagle3" if prefill else "eagle3-noprefill"
        #: Set True to keep, per request, the head's probability of its latest draft
        #: (``last_confidence``); the evaluation bins the lookahead's accuracy by it.
        self.track_confidence = False
        self.last_confidence: dict[int, float] = {}
        #: Set True to keep, per request, the head's second-best token of its latest draft, in the
        #: target vocabulary (``last_runner_up``); the evaluation measures lookahead from the two
        #: best drafts with it.
        self.track_runner_up = False
        self.last_runner_up: dict[int, int] = {}

    @classmethod
    def from_pretrained(
        cls, path, model, *, prefill: bool = True, paged: bool | None = None
    ) -> Eagle3Drafter:
        """Load an EAGLE-3 head in the public checkpoint format (``config.json`` +
        ``model.safetensors``, the EAGLE-3 / SpecForge layout) for the target ``model``, in the
        model's dtype and on its device."""
        from .models.eagle3 import Eagle3Head

        p = next(model.parameters())
        head = Eagle3Head.load(path, model.config, dtype=p.dtype, device=p.device)
        head.attach_target(model)
        head.eval()
        return cls(head, model, prefill=prefill, paged=paged)

    def capture_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(self.head.capture_layers(num_layers))

    def device_bytes(self, tokens: int) -> int:
        """The head's K and V of ``tokens`` positions (whole pages when paged)."""
        from .models.eagle3 import HEAD_PAGE_ROWS

        cfg, p = self.head.config, next(self.head.parameters())
        rows = -(-tokens // HEAD_PAGE_ROWS) * HEAD_PAGE_ROWS if self.paged else tokens
        return 2 * rows * cfg.num_key_value_heads * cfg.head_dim * p.element_size()

    def reserve(self, sizes: Sequence[int]) -> None:
        """Grow the paged pool once to hold requests of ``sizes`` positions beside the running
        ones (nothing when not ``paged``: a contiguous cache grows per request)."""
        if self.paged and sizes:
            pool = self.pool
            pool.reserve_pages(pool.pages_in_use + sum(-(-int(n) // pool.block_size) for n in sizes))

    def begin(self, req_id, prompt) -> None:
        self.end(req_id)  # a request begun again starts empty (its pages back first)
        self._states[req_id] = self._state_cls(paged=self.pool if self.paged else None)

    @property
    def pool(self):
        """The paged pool of every request's head cache (made at first use), or None when not
        ``paged``."""
        if self.paged and self._pool is None:
            from .models.eagle3 import Eagle3PagedKV

            cfg, p = self.head.config, next(self.head.parameters())
            self._pool = Eagle3PagedKV(
                cfg.num_attention_heads,
                cfg.num_key_value_heads,
                cfg.head_dim,
                dtype=p.dtype,
                device=p.device,
            )
        return self._pool

    def end(self, req_id) -> None:
        state = self._states.pop(req_id, None)
        if state is not None:
            state.release()
        self.last_confidence.pop(req_id, None)
        self.last_runner_up.pop(req_id, None)

    @torch.no_grad()
    def feed_prompt(self, req_id, prompt, features, start=0) -> None:
        """Extend the head's cache by the rows ``p = start + 1 .. start + n`` (those below ``P``):
        feature of ``p - 1``, token ``prompt[p]``, RoPE position ``p``. No draft logits are computed."""
        state = self._states.setdefault(req_id, self._state_cls())
        n, total = features.shape[0], len(prompt)
        if not 0 <= start < total or start + n > total:
            raise ValueError(
                f"feed_prompt got features of positions {start}..{start + n - 1} for a {total}-token "
                "prompt; pass the features of prompt positions only"
            )
        if state.length != start:
            raise ValueError(
                f"feed_prompt for request {req_id} starts at position {start} but the head has "
                f"{state.length} prompt rows; feed the chunks in position order, once, after begin()"
            )
        m = min(n, total - 1 - start)  # the last prompt position is paired by the first propose
        if m <= 0:
            return
        dev = features.device
        ids = torch.tensor(prompt[start + 1 : start + 1 + m], dtype=torch.long).to(dev, non_blocking=True)
        pos = torch.arange(start + 1, start + 1 + m, device=dev)
        self.head.extend(state, features[:m], ids, pos)

    @torch.no_grad()
    def propose(self, req_id, tokens, features=None) -> int:
        if features is None:
            return tokens[-1]
        state = self._states[req_id]
        dev = features.device
        pos = torch.tensor([len(tokens) - 1], device=dev)
        ids = torch.tensor([tokens[-1]], device=dev)
        feats = features.reshape(1, -1).to(next(self.head.parameters()).dtype)
        draft, h = self.head.step(state, feats, ids, pos)
        if self.track_confidence:
            self.last_confidence[req_id] = float(torch.softmax(self.head.draft_logits(h).float(), -1).max())
        if self.track_runner_up:
            second = self.head.draft_logits(h)[0].topk(2).indices[1:]
            self.last_runner_up[req_id] = int(self.head.to_target_ids(second)[0])
        return int(draft[0])

    @torch.no_grad()
    def launch_batch(self, req_ids, positions, token_ids, features) -> bool:
        """One head step for these requests, queued now (:meth:`Drafter.launch_batch`); its
        drafts (and logits, for the trackers) stay on the device until :meth:`propose_batch`."""
        if not req_ids or any(r not in self._states for r in req_ids):
            return False
        dev = features.device
        states = [self._states[r] for r in req_ids]
        feats = features.to(next(self.head.parameters()).dtype)
        if torch.is_tensor(positions):  # a speculative step's: one on where a draft was accepted
            pos = positions.to(dev).long()
        else:
            pos = torch.tensor(list(positions)).to(dev, non_blocking=True)
        draft, _, logits = self.head.step_batch(states, feats, token_ids.to(dev).long(), pos)
        self._launched = {r: i for i, r in enumerate(req_ids)}, draft, logits
        return True

    @torch.no_grad()
    def propose_batch(self, req_ids, tokens_list, features_list) -> list[int]:
        """Every request's draft from ONE head step (:meth:`Eagle3Head.step_batch`): the head's
        weights are read once per decode step instead of once per request. Each request's head
        state grows exactly as with :meth:`propose`; requests without features draft their
        current token, as there. Requests whose head step :meth:`launch_batch` queued this step
        take its drafts (one host read); the others step here."""
        launched, self._launched = self._launched, None
        out = [int(t[-1]) if f is None else 0 for t, f in zip(tokens_list, features_list, strict=True)]
        rows = [i for i, f in enumerate(features_list) if f is not None]
        if launched is not None:
            where, draft, logits = launched
            done = [i for i in rows if req_ids[i] in where]
            if done:
                pick = [where[req_ids[i]] for i in done]
                if pick == list(range(draft.shape[0])):  # every launched row, in order: no gather
                    got, lg = draft, logits
                else:
                    at = torch.tensor(pick).to(draft.device, non_blocking=True)
                    got, lg = draft.index_select(0, at), logits.index_select(0, at)
                self._track([req_ids[i] for i in done], lg)
                for i, d in zip(done, got.tolist(), strict=True):
                    out[i] = int(d)
            rows = [i for i in rows if req_ids[i] not in where]
        if not rows:
            return out
        dev = features_list[rows[0]].device
        dt = next(self.head.parameters()).dtype
        states = [self._states[req_ids[i]] for i in rows]
        feats = torch.stack([features_list[i].reshape(-1).to(device=dev, dtype=dt) for i in rows])
        ids = torch.tensor([tokens_list[i][-1] for i in rows], device=dev)
        pos = torch.tensor([len(tokens_list[i]) - 1 for i in rows], device=dev)
        draft, _, logits = self.head.step_batch(states, feats, ids, pos)
        self._track([req_ids[i] for i in rows], logits)
        for i, d in zip(rows, draft.tolist(), strict=True):
            out[i] = int(d)
        return out

    def _track(self, req_ids, logits) -> None:
        """The draft's probability and runner-up per request, where asked (the evaluation's)."""
        if self.track_confidence:
            conf = torch.softmax(logits, -1).max(dim=-1).values.tolist()
            for r, c in zip(req_ids, conf, strict=True):
                self.last_confidence[r] = float(c)
        if self.track_runner_up:
            second = self.head.to_target_ids(logits.topk(2, dim=-1).indices[:, 1]).tolist()
            for r, x in zip(req_ids, second, strict=True):
                self.last_runner_up[r] = int(x)


#: Heads bundled in the wheel, by the model name that ``LLM`` / ``LLMEngine`` accept.
BUNDLED_HEADS = {"smollm2": "data/eagle3-smollm2"}


def make_drafter(spec: str | Drafter | None, model=None, model_name: str | None = None) -> Drafter | None:
    """``"ngram"``, ``"previous-query"``, ``"eagle3"`` (the bundled head of the bundled model
    ``model_name``, for ``model``), ``None`` or a Drafter instance."""
    if spec is None or isinstance(spec, Drafter):
        return spec
    if spec == "ngram":
        return NgramDrafter()
    if spec in ("previous-query", "none"):
        return PreviousQueryDrafter()
    if spec == "eagle3":
        from pathlib import Path

        rel = BUNDLED_HEADS.get((model_name or "").lower())
        if rel is None or model is None:
            raise ConfigError(
                "drafter='eagle3' loads the bundled head, which exists for "
                f"{sorted(BUNDLED_HEADS)} only (got model {model_name!r}); for another model pass "
                "drafter=Eagle3Drafter.from_pretrained(HEAD_DIR, model)"
            )
        return Eagle3Drafter.from_pretrained(Path(__file__).parent / rel, model)
    raise ConfigError(
        f"unknown drafter {spec!r}; use 'ngram', 'eagle3', 'previous-query', or pass a Drafter "
        "instance (Eagle3Drafter.from_pretrained(dir, model), OracleDrafter(continuations))"
    )
