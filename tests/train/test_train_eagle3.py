"""EAGLE-3 training (python -m oasiskv.train.eagle3): TTT forward, data stream, vocab, smoke run."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from oasiskv.eval import corpus
from oasiskv.models.config import ModelConfig
from oasiskv.models.eagle3 import Eagle3Head
from oasiskv.models.transformer import CausalLM
from oasiskv.train import eagle3 as tr
from support.configs import LLAMA_DRAFT_TARGET
from support.fakes import ByteTokenizer

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def target():
    cfg = LLAMA_DRAFT_TARGET
    return CausalLM.random(cfg, seed=1)


@pytest.fixture(scope="module")
def head(target):
    sel = torch.arange(0, 300, 3)  # 100 draft tokens
    return tr.new_head(target, sel, seed=0, device="cpu")


def test_new_head_maps_and_inits(target, head):
    sel = torch.arange(0, 300, 3)
    assert torch.equal(head.to_target_ids(torch.arange(len(sel))), sel)
    assert int(head.t2d.sum()) == len(sel) and bool(head.t2d[sel].all())
    assert torch.equal(head.lm_head.weight, target.lm_head[sel])
    assert torch.equal(head.midlayer.hidden_norm.weight, torch.ones(64))
    # Seeded: the same seed gives the same head.
    again = tr.new_head(target, sel, seed=0, device="cpu")
    assert all(
        torch.equal(a, b)
        for a, b in zip(head.state_dict().values(), again.state_dict().values(), strict=True)
    )


def test_ttt_pass0_equals_forward_train(target, head):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 300, (2, 40), generator=g)
    feats, z, greedy = tr.target_pass(target, tokens, torch.arange(0, 300, 3), full_argmax=True)
    outs = tr.ttt_forward(head, feats, tokens, 3)
    assert len(outs) == 3 and outs[0].shape == (2, 39, 100)
    for b in range(2):
        ref = head.forward_train(feats[b, :-1], tokens[b, 1:], torch.arange(1, 40))
        torch.testing.assert_close(outs[0][b], ref, atol=1e-5, rtol=1e-5)
    # Restricted target logits are the full ones at the draft ids; greedy is the full argmax.
    from oasiskv.models.transformer import dense_causal_attn

    full, _ = target(tokens[0], torch.arange(40), dense_causal_attn())
    torch.testing.assert_close(z[0], full[:, torch.arange(0, 300, 3)], atol=1e-4, rtol=1e-4)
    assert torch.equal(greedy[0], full.argmax(-1))


def test_ttt_passes_are_causal(target, head):
    """Pass k, row r reads tokens up to r + 1 + k only: later tokens leave it unchanged."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 300, (1, 30), generator=g)
    sel = torch.arange(0, 300, 3)
    feats, _, _ = tr.target_pass(target, tokens, sel)
    outs = tr.ttt_forward(head, feats, tokens, 3)
    j = 20
    t2 = tokens.clone()
    t2[0, j] = (t2[0, j] + 1) % 300
    f2, _, _ = tr.target_pass(target, t2, sel)
    outs2 = tr.ttt_forward(head, f2, t2, 3)
    for k in range(3):
        last_clean = j - 2 - k  # rows r with r + 1 + k < j
        torch.testing.assert_close(
            outs[k][0, : last_clean + 1], outs2[k][0, : last_clean + 1], atol=1e-5, rtol=1e-5
        )
        assert not torch.allclose(outs[k][0, last_clean + 1], outs2[k][0, last_clean + 1])


def test_ttt_loss_decreases_with_training(target):
    """A few AdamW steps on one batch close most of the gap between the loss and its floor (the
    target's own entropy over the draft vocabulary, summed over the weighted passes)."""
    sel = torch.arange(0, 300, 3)
    h = tr.new_head(target, sel, seed=0, device="cpu")
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 300, (2, 24), generator=g)
    feats, z, _ = tr.target_pass(target, tokens, sel)
    n = tokens.shape[1] - 1
    floor = 0.0
    for k in range(2):
        p = torch.softmax(z[:, 1 + k : 1 + n], dim=-1)
        floor += 0.8**k * float(-(p * p.log()).sum(-1).mean())
    opt = torch.optim.AdamW(h.parameters(), lr=3e-3)
    gaps = []
    for _ in range(10):
        loss, per_pass, accs = tr.ttt_loss(tr.ttt_forward(h, feats, tokens, 2), z, 0.8)
        opt.zero_grad()
        loss.backward()
        opt.step()
        gaps.append(float(loss.detach()) - floor)
        assert per_pass.shape == (2,) and accs.shape == (2,)
    assert gaps[0] > 0 and gaps[-1] < 0.5 * gaps[0], gaps


def test_token_stream_resumes_exactly(tmp_path):
    root = tmp_path / "lib"
    for i in range(7):
        (root / f"m{i}.py").parent.mkdir(parents=True, exist_ok=True)
        (root / f"m{i}.py").write_text(f"# module {i}\n" + "x = 1\n" * (i * 5 + 1))
    files = corpus.list_files([("stdlib", root)])
    tok = ByteTokenizer()
    s = tr.TokenStream(tok, files, sep=0, files_per_read=2)
    first = s.batch(2, 16)
    cur = s.cursor
    rest = [s.batch(2, 16) for _ in range(30)]  # wraps around the corpus (about 760 bytes)
    s2 = tr.TokenStream(tok, files, sep=0, cursor=cur, files_per_read=3)
    assert all(torch.equal(a, s2.batch(2, 16)) for a in rest)
    assert first.shape == (2, 16) and s.epoch >= 1
    # The stream is the files in order, each followed by the separator.
    want = list((files[0].path.read_text()).encode()) + [0]
    assert first.flatten().tolist()[: len(want)] == want[:32]


def test_draft_vocab_is_the_most_frequent_tokens(tmp_path):
    root = tmp_path / "lib"
    root.mkdir()
    (root / "a.py").write_text("aaaa bbb cc d\n" * 10)
    files = corpus.list_files([("stdlib", root)])
    sel = tr.draft_vocab(ByteTokenizer(), files, sep=0, vocab_size=300, size=3, tokens=100)
    assert sel.tolist() == sorted([ord("a"), ord("b"), ord(" ")])
    # Counted in chunks, the same vocabulary (the stream wraps around the 140-byte file here).
    for tokens in (100, 1000):
        want = tr.draft_vocab(ByteTokenizer(), files, 0, 300, 5, tokens)
        assert torch.equal(tr.draft_vocab(ByteTokenizer(), files, 0, 300, 5, tokens, chunk=7), want)


def test_split_corpus_is_train_files_heldout_and_fingerprint_in_one_walk():
    train, heldout, fp = tr.split_corpus("stdlib", seed=3)
    assert train == corpus.train_files(source="stdlib", seed=3)
    assert heldout == corpus.list_files(source="stdlib", split="heldout")
    assert fp == corpus.fingerprint(corpus.list_files(source="stdlib"))


def _reparse(cmd: str) -> dict:
    words = shlex.split(cmd)
    assert words[:3] == ["python", "-m", "oasiskv.train.eagle3"], cmd
    return vars(tr.build_parser().parse_args(words[3:]))


def test_reproduce_command_repeats_every_argument_that_affects_the_result():
    parser = tr.build_parser()
    dests = {a.dest for a in parser._actions if a.option_strings and a.dest != "help"}
    assert tr.NOT_REPRODUCED <= dests
    run = vars(parser.parse_args(["--out", "x"]))
    # A value unlike the default for every argument that is repeated.
    run.update(
        model="/some dir/with space", device="cuda", steps=1234, seq_len=512, batch_size=3, lr=1e-3,
        warmup=17, min_lr_ratio=0.05, weight_decay=0.0, grad_clip=0.5, ttt_steps=2, ttt_decay=0.7,
        draft_vocab=4096, vocab_tokens=2_000_000, eval_seqs=8, source="stdlib", save_dtype="float32",
        seed=5,
    )  # fmt: skip
    defaults = vars(parser.parse_args(["--out", "x"]))
    assert all(run[d] != defaults[d] for d in dests - tr.NOT_REPRODUCED), "extend the test's values"
    back = _reparse(tr.reproduce_command(run, parser))
    for d in dests - tr.NOT_REPRODUCED:
        assert back[d] == run[d] and type(back[d]) is type(run[d]), d
    assert back["out"] == "DIR"


def test_lr_schedule():
    assert tr.lr_at(0, 100, 1.0, 10, 0.1) == pytest.approx(0.1)
    assert tr.lr_at(9, 100, 1.0, 10, 0.1) == pytest.approx(1.0)
    assert tr.lr_at(100, 100, 1.0, 10, 0.1) == pytest.approx(0.1)


@pytest.fixture()
def tiny_target(monkeypatch):
    """main() on the tiny random target with a byte tokenizer (the corpus stays the real one)."""
    import oasiskv.models.loader as loader

    cfg = LLAMA_DRAFT_TARGET
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: (CausalLM.random(cfg, seed=1), ByteTokenizer()))


def test_minutes_fill_the_budget_and_the_reproduce_command_repeats_the_run(
    tmp_path, tiny_target, monkeypatch
):
    """Without --steps: the total is fixed at step TIME_TO from the time of steps TIME_FROM..TIME_TO
    (here 2..6, on a deterministic clock), the run ends within its budget, near it, with the
    schedule completed; the reproduce command retrains the same head bit for bit."""
    monkeypatch.setattr(tr, "TIME_FROM", 2)
    monkeypatch.setattr(tr, "TIME_TO", 6)
    monkeypatch.setattr(tr, "MARGIN", 0.8)

    class Clock:
        """Advances 10 ms per reading: the planned step count no longer depends on how busy the
        machine is (a contended CPU once made the real steps outrun the estimate)."""

        t = 0.0

        def perf_counter(self) -> float:
            self.t += 0.01
            return self.t

    monkeypatch.setattr(tr, "time", Clock())
    common = ["--seq-len", "32", "--batch-size", "2", "--source", "stdlib", "--threads", "1"]
    minutes = 0.1
    rc = tr.main(
        ["--out", str(tmp_path / "a"), "--minutes", str(minutes), "--no-progress", "--lr", "2e-3"]
        + ["--vocab-tokens", "5000", "--eval-seqs", "1", "--ttt-steps", "2", "--draft-vocab", "64"]
        + ["--warmup", "5", *common]
    )
    assert rc == 0
    a = json.loads((tmp_path / "a" / "training.json").read_text())
    budget = minutes * 60
    assert a["reproduce_exact"] and a["steps"] > 6, a["steps"]
    assert 0.5 * budget < a["train_s"] <= budget + 0.5, a["train_s"]
    assert a["warmup_steps"] == 5
    assert set(a["setup_s"]) >= {"load", "corpus_listing", "heldout_windows", "draft_vocab", "total"}
    log = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == a["steps"]
    assert log[-1]["lr"] == pytest.approx(tr.lr_at(a["steps"] - 1, a["steps"], 2e-3, 5, 0.1))
    # The reproduce command: every result-affecting argument of the run, the exact steps.
    back = _reparse(a["reproduce"])
    assert {k: back[k] for k in a["reproduce_args"]} == a["reproduce_args"]
    assert a["reproduce_args"] == {
        **{k: v for k, v in a["args"].items() if k not in tr.NOT_REPRODUCED},
        "steps": a["steps"], "warmup": 5, "device": "cpu",
    }  # fmt: skip
    argv = shlex.split(a["reproduce"])[3:]
    argv[argv.index("DIR")] = str(tmp_path / "b")
    assert tr.main([*argv, "--no-progress", "--threads", "1"]) == 0
    b = json.loads((tmp_path / "b" / "training.json").read_text())
    assert b["steps"] == a["steps"] and b["reproduce"] == a["reproduce"]
    from safetensors.torch import load_file

    wa, wb = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_smoke_run_on_smollm2_saves_a_loadable_head_with_lower_loss(tmp_path):
    """The documented CPU smoke configuration: SmolLM2 frozen, 5 steps of 128 tokens (< 60 s)."""
    rc = tr.main(
        ["--out", str(tmp_path), "--steps", "5", "--seq-len", "128", "--threads", "2", "--no-progress"]
        + ["--lr", "6e-4", "--ttt-steps", "3", "--vocab-tokens", "150000"]
    )
    assert rc == 0
    summary = json.loads((tmp_path / "training.json").read_text())
    assert summary["steps"] == 5 and summary["capture_layers"] == [2, 15, 27]
    back = _reparse(summary["reproduce"])
    assert (back["steps"], back["lr"], back["ttt_steps"], back["vocab_tokens"]) == (5, 6e-4, 3, 150000)
    assert (back["warmup"], back["seq_len"], back["batch_size"], back["eval_seqs"]) == (1, 128, 2, 2)
    assert summary["heldout_after"]["loss"] < summary["heldout_before"]["loss"]
    assert summary["head_file_bytes"] <= 25 * 1024 * 1024 and summary["head_within_25MB"]
    assert 0.0 <= summary["acceptance"] <= 1.0
    assert (tmp_path / "train_log.jsonl").read_text().count("\n") >= 2
    assert not (tmp_path / "train_state.pt").exists()
    # Loadable in the public format (the target config read back from the head's own config.json).
    raw = json.loads((tmp_path / "config.json").read_text())
    cfg = ModelConfig.from_hf_dict({**raw, "num_hidden_layers": 30})
    h = Eagle3Head.load(tmp_path, cfg).attach_target(torch.zeros(cfg.vocab_size, cfg.hidden_size))
    assert h.draft_vocab_size == summary["draft_vocab"] == 8192
    # It drafts through the library's drafter.
    from oasiskv.drafters import Eagle3Drafter

    d = Eagle3Drafter(h, torch.zeros(cfg.vocab_size, cfg.hidden_size))
    d.begin(0, [1, 2, 3])
    tok = d.propose(0, [1, 2, 3], torch.zeros(3 * cfg.hidden_size))
    assert 0 <= tok < cfg.vocab_size and bool(h.t2d[tok])
