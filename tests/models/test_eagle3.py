"""EAGLE-3 draft head: checkpoint format, stateful drafting vs teacher forcing, vocab mapping."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from oasiskv.errors import CheckpointError, ConfigError, ShapeError
from oasiskv.models.eagle3 import Eagle3Head, Eagle3State, eagle3_capture_layers
from oasiskv.models.transformer import CausalLM, dense_causal_attn
from support.configs import LLAMA_DRAFT_TARGET

torch.set_num_threads(2)

TARGET = LLAMA_DRAFT_TARGET
DRAFT_VOCAB = 120


@pytest.fixture(scope="module")
def target():
    return CausalLM.random(TARGET, seed=1)


@pytest.fixture(scope="module")
def head(target):
    return Eagle3Head.random(TARGET, DRAFT_VOCAB, seed=2).attach_target(target)


def features_and_tokens(target: CausalLM, n: int, seed: int = 0):
    """Real target features: feature row t = target state at position t-1, token row t = token t."""
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, TARGET.vocab_size, (n + 1,), generator=g)
    L = target.num_layers
    _, cap = target(
        seq, torch.arange(n + 1), dense_causal_attn(), capture_layers=Eagle3Head.capture_layers(L)
    )
    feats = Eagle3Head.gather_features(cap, L)  # [n+1, 3H]
    return feats[:-1], seq[1:], torch.arange(1, n + 1)


def test_capture_layers():
    assert Eagle3Head.capture_layers(30) == (2, 15, 27)  # SmolLM2
    assert eagle3_capture_layers(32) == (2, 16, 29)
    assert eagle3_capture_layers(8) == (2, 4, 5)
    with pytest.raises(ConfigError, match="at least 7 layers"):
        eagle3_capture_layers(6)


def test_gather_features_order(target):
    ids = torch.arange(5)
    _, cap = target(ids, torch.arange(5), dense_causal_attn(), capture_layers=(2, 4, 5))
    f = Eagle3Head.gather_features(cap, 8)
    H = TARGET.hidden_size
    assert f.shape == (5, 3 * H)
    assert (
        torch.equal(f[:, :H], cap[2])
        and torch.equal(f[:, H : 2 * H], cap[4])
        and torch.equal(f[:, 2 * H :], cap[5])
    )
    with pytest.raises(ShapeError, match="capture_layers"):
        Eagle3Head.gather_features({2: cap[2]}, 8)


def test_step_matches_forward_train(head, target):
    n = 13
    feats, toks, pos = features_and_tokens(target, n)
    logits = head.forward_train(feats, toks, pos)
    assert logits.shape == (n, DRAFT_VOCAB) and logits.dtype == torch.float32
    expect = head.to_target_ids(logits.argmax(-1))
    state = Eagle3State()
    drafts, hiddens = [], []
    for a, b in [(0, 4), (4, 5), (5, 6), (6, 11), (11, 12), (12, 13)]:  # prefill chunk, then single steps
        d, h = head.step(state, feats[a:b], toks[a:b], pos[a:b])
        drafts.append(d)
        hiddens.append(h)
    assert state.length == n
    assert torch.equal(torch.cat(drafts), expect)
    torch.testing.assert_close(head.draft_logits(torch.cat(hiddens)), logits, atol=1e-5, rtol=1e-5)
    # the draft depends on the feature, the token and the history (not a constant)
    assert len(set(torch.cat(drafts).tolist())) > 1


def test_state_truncate_replays_identically(head, target):
    feats, toks, pos = features_and_tokens(target, 8, seed=3)
    state = Eagle3State(capacity=2)  # forces growth
    d1, _ = head.step(state, feats, toks, pos)
    state.truncate(5)
    d2, _ = head.step(state, feats[5:], toks[5:], pos[5:])
    assert torch.equal(d1[5:], d2)
    with pytest.raises(ShapeError):
        state.truncate(99)
    # the draft's own hidden state can be fed back (multi-step drafting skips fc)
    _, h = head.step(state, feats[-1:], toks[-1:], pos[-1:])
    d3, h3 = head.step(state, h, d2[-1:], pos[-1:] + 1)
    assert d3.shape == (1,) and h3.shape == (1, TARGET.hidden_size)


def test_d2t_t2d_mapping(head):
    draft_ids = torch.arange(DRAFT_VOCAB)
    tgt = head.to_target_ids(draft_ids)
    assert torch.equal(tgt, draft_ids + head.d2t)
    assert tgt.min() >= 0 and tgt.max() < TARGET.vocab_size
    assert torch.all(tgt[1:] > tgt[:-1])  # sorted subset, no duplicates
    assert int(head.t2d.sum()) == DRAFT_VOCAB and head.t2d[tgt].all()
    assert head.d2t.dtype == torch.int64 and head.t2d.dtype == torch.bool
    assert not torch.equal(tgt, draft_ids)  # a real remapping
    # step returns target ids: all of them lie in the draft vocabulary's image
    feats = torch.randn(6, 3 * TARGET.hidden_size, generator=torch.Generator().manual_seed(0))
    d, _ = head.step(Eagle3State(), feats, torch.arange(6), torch.arange(6))
    assert head.t2d[d].all()


def test_save_load_round_trip(head, target, tmp_path):
    head.save(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB and cfg["num_hidden_layers"] == 1
    assert cfg["tie_word_embeddings"] is False  # the draft lm_head is never the embedding
    tensors = load_file(str(tmp_path / "h" / "model.safetensors"))
    H = TARGET.hidden_size
    assert tensors["fc.weight"].shape == (H, 3 * H)
    assert tensors["midlayer.self_attn.q_proj.weight"].shape == (TARGET.q_size, 2 * H)
    assert tensors["lm_head.weight"].shape == (DRAFT_VOCAB, H)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].shape == (TARGET.vocab_size,)
    expected = {
        "fc.weight",
        "midlayer.input_layernorm.weight",
        "midlayer.hidden_norm.weight",
        "midlayer.post_attention_layernorm.weight",
        "norm.weight",
        "lm_head.weight",
        "d2t",
        "t2d",
        *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert set(tensors) == expected  # the target's embedding is not duplicated

    loaded = Eagle3Head.load(tmp_path / "h", TARGET)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(ConfigError, match="attach_target"):
        loaded.step(Eagle3State(), torch.zeros(1, 3 * H), torch.tensor([1]), torch.tensor([0]))
    loaded.attach_target(target)
    feats, toks, pos = features_and_tokens(target, 6, seed=4)
    assert torch.equal(
        loaded.step(Eagle3State(), feats, toks, pos)[0], head.step(Eagle3State(), feats, toks, pos)[0]
    )

    # a head that carries its own embedding saves and uses it
    own = Eagle3Head.random(TARGET, DRAFT_VOCAB, seed=5, with_embedding=True)
    own.save(tmp_path / "own")
    assert "embed_tokens.weight" in load_file(str(tmp_path / "own" / "model.safetensors"))
    again = Eagle3Head.load(tmp_path / "own", TARGET)
    assert torch.equal(
        again.step(Eagle3State(), feats, toks, pos)[0], own.step(Eagle3State(), feats, toks, pos)[0]
    )


def test_load_errors(head, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Eagle3Head.load(tmp_path / "nope", TARGET)
    (tmp_path / "e").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        Eagle3Head.load(tmp_path / "e", TARGET)
    head.save(tmp_path / "h")
    sd = load_file(str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="vocabulary of 300 tokens, the target has 301"):
        Eagle3Head.load(tmp_path / "h", TARGET.replace(vocab_size=301))
    with pytest.raises(CheckpointError, match="target hidden size 64"):
        Eagle3Head.load(tmp_path / "h", TARGET.replace(hidden_size=128, num_attention_heads=8))

    missing = {k: v for k, v in sd.items() if k != "midlayer.hidden_norm.weight"}
    save_file(missing, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"midlayer\.hidden_norm\.weight \(64,\)"):
        Eagle3Head.load(tmp_path / "h", TARGET)

    bad = dict(sd, **{"fc.weight": sd["fc.weight"][:, :128].clone()})
    save_file(bad, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"fc\.weight.*\(64, 128\), expected \(64, 192\)"):
        Eagle3Head.load(tmp_path / "h", TARGET)

    nan = sd["fc.weight"].clone()
    nan[3, 5] = float("nan")
    save_file(dict(sd, **{"fc.weight": nan}), str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"fc\.weight \(EAGLE-3 head\).*1 NaN/inf"):
        Eagle3Head.load(tmp_path / "h", TARGET)

    (tmp_path / "h" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors or pytorch_model.bin"):
        Eagle3Head.load(tmp_path / "h", TARGET)


def test_reference_style_pytorch_bin_checkpoint(head, tmp_path):
    """The EAGLE-3 reference releases ship pytorch_model.bin with the same tensor names."""
    d = tmp_path / "ref"
    d.mkdir()
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6,
        "vocab_size": 300,
        "draft_vocab_size": DRAFT_VOCAB,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "torch_dtype": "float16",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    torch.save(
        {k: v.half() if v.is_floating_point() else v for k, v in head.state_dict().items()},
        d / "pytorch_model.bin",
    )
    loaded = Eagle3Head.load(d, TARGET, dtype=torch.float32)
    torch.testing.assert_close(loaded.fc.weight, head.fc.weight.half().float())
    assert torch.equal(loaded.d2t, head.d2t)


def test_forward_train_trains_the_head_only(target):
    head = Eagle3Head.random(TARGET, DRAFT_VOCAB, seed=7).attach_target(target)
    feats, toks, pos = features_and_tokens(target, 10, seed=5)
    logits = head.forward_train(feats, toks)
    loss = torch.nn.functional.cross_entropy(logits, torch.randint(0, DRAFT_VOCAB, (10,)))
    loss.backward()
    assert head.fc.weight.grad is not None and head.midlayer.self_attn.q_proj.weight.grad is not None
    assert target.embed_tokens.weight.grad is None
    assert all(p is not target.embed_tokens.weight for p in head.parameters())
    with pytest.raises(ShapeError, match="width"):
        head.forward_train(feats[:, :100], toks)


def test_saved_config_never_ties_the_draft_lm_head(tmp_path):
    """A tied target (SmolLM2 is one) must not make the head's config claim tied embeddings."""
    tied = TARGET.replace(tie_word_embeddings=True)
    Eagle3Head.random(tied, draft_vocab_size=DRAFT_VOCAB, seed=3).save(tmp_path / "t")
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
