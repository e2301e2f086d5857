"""The transformers integration (clients/python/pion/hf.py) against a live server, on random-
weight models built from configs (nothing is downloaded). Needs torch and transformers: on the
GPU machine (`scripts/test-gpu.sh` runs it), skipped elsewhere with the reason.

- Stage 1 exactness: greedy generation of 32 tokens with the Pion cache — the miss path
  (prefill + store) and the hit path (a fresh PionPromptCache filled from Pion) — equals vanilla
  `generate` token for token, with max |logit difference| over the suffix printed: a Llama-style
  GQA model (fp32 over TCP and over the Unix socket's shared memory; fp16 and bf16 models with
  their own codecs on a GPU), a sliding-window model (Mistral, window < prefix) and a hybrid
  with recurrent layers (LFM2: short-conv layers through SSM.PREFIX).
- Lossy codecs (fp16 storage of an fp32 model, int8, turbo4): the first generated token is the
  uncached model's (or that of its cache rounded to the codec by torch/numpy, an independent
  encoder that reproduces the server's rows bit for bit), and the suffix logits' error relative
  to their spread is at most LOSSY_LOGIT_SLACK times the rounding's own (bounds provisional until
  measured on the GPU machine).
- fp8 and fp8_e5m2 (e4m3fn / e5m2 with a scale per token row): Stage 1 from such a namespace,
  Stage 2 over the attention slots bound from it (fp8: the server attends over the e4m3 bytes;
  fp8_e5m2 decodes to fp32 slots) and, on a GPU, the IPC path: token agreement and logit error
  against the uncached model printed; asserted: the first generated token agrees and the
  suffix logits' error relative to their spread, RMS(Δ) / RMS(logits − mean), is at most
  FP8_LOGIT_SLACK times that of torch's own rounding of the exact cache to the same fp8.
- A stale identity (same config, other weights) misses; a server restart between store and hit
  (KV.PREFIX.SAVE, the disk tier) hits.
- Stage 2: the full-attention layers computed by ATTEND.PREFIX.QUERY_FUSED equal vanilla token
  for token.
"""
from __future__ import annotations

import os
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))

torch = pytest.importorskip("torch", reason="the transformers integration needs PyTorch "
                            "(run on the GPU machine: scripts/test-gpu.sh)")
transformers = pytest.importorskip("transformers", reason="the transformers integration needs "
                                   "transformers (run on the GPU machine: scripts/test-gpu.sh)")

import pion  # noqa: E402
import pion.cuda_ipc  # noqa: E402
import pion.hf  # noqa: E402
from pionlib import HOST  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEW = 32


def llama(seed, dtype=torch.float32, **kw):
    # head_dim 64, 2 K/V heads: 128 values per token row (a multiple of turbo's block)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024,
                                   num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, max_position_embeddings=1024,
                                   initializer_range=0.08, **kw)
    torch.manual_seed(seed)
    return _ready(transformers.LlamaForCausalLM(cfg), dtype)


def _ready(model, dtype):
    model = model.to(DEV, dtype).eval()
    model.generation_config.pad_token_id = 0
    return model


def prompt(seed, n):
    g = np.random.default_rng(seed)
    return torch.from_numpy(g.integers(5, 500, n)).long()


def generate(model, full, cache=None):
    with torch.no_grad():
        out = model.generate(input_ids=full[None].to(DEV), past_key_values=cache,
                             attention_mask=torch.ones(1, full.numel(), dtype=torch.long,
                                                       device=DEV),
                             max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    return out[0, full.numel():].tolist()


def suffix_logits(model, full, p, cache=None):
    with torch.no_grad():
        if cache is None:
            return model(input_ids=full[None].to(DEV)).logits[0, p:].float()
        return model(input_ids=full[None, p:].to(DEV), past_key_values=cache).logits[0].float()


def client_for(srv, shm=False):
    if shm:
        return pion.Client(unix_socket_path=srv.unix_path, socket_timeout=60)
    return pion.Client(HOST, srv.port, socket_timeout=60)


@pytest.fixture
def server(pion_factory, tmp_path):
    srv = pion_factory("--workers", "2", "--unixsocket", str(tmp_path / "pion.sock"))
    srv.unix_path = str(tmp_path / "pion.sock")
    return srv


def check_exact(model, client, prefix_len=96, suffix_len=8, codec=None, label="",
                transport="auto"):
    """Miss, then hit from a fresh object: both generate exactly what vanilla does."""
    prefix, suffix = prompt(1, prefix_len), prompt(2, suffix_len)
    full = torch.cat([prefix, suffix])
    want = generate(model, full)
    pc = pion.hf.PionPromptCache(model, client, codec=codec, transport=transport)
    assert not pc.lookup(prefix)
    got_miss = generate(model, full, pc.get_or_prefill(prefix))
    assert pc.last["hit"] is False and pc.last["bytes"] > 0
    pc2 = pion.hf.PionPromptCache(model, client, codec=codec, transport=transport)
    assert pc2.lookup(prefix)
    got_hit = generate(model, full, pc2.get_or_prefill(prefix))
    assert pc2.last["hit"] is True
    diff = (suffix_logits(model, full, prefix_len) -
            suffix_logits(model, full, prefix_len, pc2.fetch(prefix))).abs().max().item()
    agree = sum(a == b for a, b in zip(want, got_hit))
    print("\n%s: codec %s, path %s, max|logit diff| %.3g, tokens %d/%d (miss %d/%d)" % (
        label, pc2.codec, pc2.last["path"], diff, agree, NEW,
        sum(a == b for a, b in zip(want, got_miss)), NEW))
    return want, got_miss, got_hit, diff


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_llama_gqa_stage1_exact(server, shm):
    model = llama(0)
    want, miss, hit, diff = check_exact(model, client_for(server, shm), label="llama gqa fp32")
    assert miss == want and hit == want
    assert diff < 1e-3


@pytest.mark.skipif(DEV != "cuda", reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_llama_gqa_stage1_ipc_exact(server, dtype):
    """transport="ipc": the server binds the namespace into its GPU slots and the cache reads
    them device to device (ATTEND.PREFIX.EXPORT + CUDA IPC)."""
    client = ipc_client(server)
    model = llama(0, dtype)
    want, miss, hit, diff = check_exact(model, client, label="llama %s ipc" % dtype,
                                        transport="ipc")
    assert miss == want and hit == want
    assert diff < 1e-3


def ipc_client(srv):
    client = client_for(srv, shm=True)
    if client.execute("INFO", "attention").get("attention_backend") != "cuda":
        pytest.skip("the server keeps attention slots in host memory (run it with "
                    "--attention-backend cuda: scripts/test-gpu.sh does)")
    return client


@pytest.mark.skipif(DEV != "cuda", reason="CUDA IPC needs a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_ipc_aliases_slots_of_the_model_dtype(server, dtype):
    """A namespace of the model's dtype binds slots of that dtype (bf16 stays bf16), and the
    fetched cache aliases them: no copy; each export's lease is held until its layer's first
    update and released with the next request; a deep copy of the cache is independent."""
    client = ipc_client(server)
    model = llama(5, dtype)
    prefix, suffix = prompt(7, 64), prompt(8, 8)
    full = torch.cat([prefix, suffix])
    pc = pion.hf.PionPromptCache(model, client, transport="ipc")
    pc.get_or_prefill(prefix)  # miss: prefill and store
    cache = pc.fetch(prefix)   # bind, export
    base = pc.namespace_for(prefix)
    slots = client.attend.info(pc._slot_sid(base, "full"))
    want_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]
    assert len(slots) == 4 and all(m["dtype"] == want_dtype for m in slots)
    def held():  # leases the server holds (this test's server has no other client)
        return pion._wire.parse_map(client.execute("SHM.INFO"))["leases"]

    assert held() == 4
    spans = [(m.ptr, m.ptr + m.bytes.numel()) for m in pion.cuda_ipc._open.values()]
    for layer in cache.layers:
        assert "_pion_hold" in vars(layer)  # holds its lease until the first update
        assert any(a <= layer.keys.data_ptr() < b for a, b in spans)  # the server's memory
        assert layer.keys.dtype == dtype
    want = generate(model, full)
    # A deep copy (how transformers' docs reuse a prompt cache) owns cloned tensors: using it
    # retires nothing, and the original still reads the server's slots under its leases.
    import copy
    dup = copy.deepcopy(cache)
    assert generate(model, full, dup) == want
    assert pc._retired == [] and held() == 4
    assert generate(model, full, cache) == want
    assert all("_pion_hold" not in vars(layer) for layer in cache.layers)
    assert len(pc._retired) == 4 and held() == 4  # retired, released with the next request
    again = pc.fetch(prefix)
    assert pc._retired == [] and held() == 4  # the old four released, four new ones
    assert generate(model, full, again) == want


@pytest.mark.skipif(DEV != "cuda", reason="CUDA IPC needs a GPU")
def test_ipc_alias_refuses_after_its_lease_expired(pion_factory, tmp_path):
    """A cache used after its exports' leases expired would read memory the server may have
    reused: its first update raises instead."""
    srv = pion_factory("--workers", "2", "--unixsocket", str(tmp_path / "pion.sock"),
                       "--shm-lease-ttl-ms", "300")
    srv.unix_path = str(tmp_path / "pion.sock")
    client = ipc_client(srv)
    model = llama(5, torch.bfloat16)
    prefix, suffix = prompt(7, 64), prompt(8, 8)
    pc = pion.hf.PionPromptCache(model, client, transport="ipc")
    pc.get_or_prefill(prefix)
    cache = pc.fetch(prefix)
    time.sleep(0.5)
    with pytest.raises(pion.PionError, match="expired"):
        generate(model, torch.cat([prefix, suffix]), cache)
    assert generate(model, torch.cat([prefix, suffix]), pc.fetch(prefix)) == \
        generate(model, torch.cat([prefix, suffix]))


@pytest.mark.skipif(DEV != "cuda", reason="half-precision models run on the GPU")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_half_models_with_their_codec_exact(server, dtype):
    model = llama(0, dtype)
    want, miss, hit, _ = check_exact(model, client_for(server), label="llama %s" % dtype)
    assert miss == want and hit == want


def test_sliding_window_model_exact(server):
    cfg = transformers.MistralConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=4, num_attention_heads=8,
                                     num_key_value_heads=2, max_position_embeddings=1024,
                                     sliding_window=32, initializer_range=0.08)
    torch.manual_seed(0)
    model = _ready(transformers.MistralForCausalLM(cfg), torch.float32)
    pc = pion.hf.PionPromptCache(model, client_for(server))
    assert set(pc.plan.groups) == {"swa32"}, pc.plan.groups
    want, miss, hit, _ = check_exact(model, client_for(server), label="mistral swa32")
    assert miss == want and hit == want


def test_hybrid_recurrent_model_exact(server):
    if not hasattr(transformers, "Lfm2Config"):
        pytest.skip("this transformers has no LFM2 (hybrid conv/attention)")
    cfg = transformers.Lfm2Config(vocab_size=512, hidden_size=256, intermediate_size=512,
                                  num_hidden_layers=4, num_attention_heads=8,
                                  num_key_value_heads=2, max_position_embeddings=1024,
                                  layer_types=["conv", "full_attention", "conv",
                                               "full_attention"], initializer_range=0.08)
    torch.manual_seed(0)
    model = _ready(transformers.Lfm2ForCausalLM(cfg), torch.float32)
    pc = pion.hf.PionPromptCache(model, client_for(server))
    assert pc.plan.linear == [0, 2] and pc.plan.groups == {"full": [1, 3]}, pc.plan
    want, miss, hit, _ = check_exact(model, client_for(server), label="lfm2 hybrid")
    assert miss == want and hit == want


# Lossy codecs against the same model with its prefix K/V rounded by torch and numpy to the
# codec as src/store/codec/README.md specifies (token rows over every K/V head, as KV.PREFIX stores
# them; the encoders below reproduce the server's V.FETCH of the same rows bit for bit, checked
# on the CPU box for fp16, int8 and turbo4/3/2). Pion's cache must give the suffix logits that
# rounding gives — relative error (logit_rel_err) at most LOSSY_LOGIT_SLACK times the rounding's
# own, plus 1e-3 — and its first token. PROVISIONAL: the codecs' logit errors on this model are
# not measured yet (transformers is on the GPU machine only); expected from the codecs' relative
# MSE (README table) scaled like fp8's 0.14: fp16 ~1e-3, int8 ~0.03, turbo4 ~0.5 of the spread.
LOSSY_LOGIT_SLACK = 1.05


def _token_rows(x):
    """[B, H, T, D] -> float32 [B*T, H*D]: one row per token over every K/V head."""
    b, h, t, d = x.shape
    return x.float().permute(0, 2, 1, 3).reshape(b * t, h * d), (b, h, t, d)


def _int8_rows(rows):
    """q8_0-like: blocks of 32, fp16 scale amax/127, round half away from zero."""
    n, dim = rows.shape
    blocks = rows.reshape(n, dim // 32, 32)
    scale = (blocks.abs().amax(-1, keepdim=True) / 127).clamp(max=65504).half().float()
    y = blocks * torch.where(scale != 0, 1 / scale, torch.zeros_like(scale))
    q = (torch.sign(y) * torch.floor(y.abs() + 0.5)).clamp(-127, 127)
    return (q * scale).reshape(n, dim)


def _turbo_rows(rows, bits, n=128):
    """TurboQuant MSE (README "Encode"): rotate D2·H·D1, nearest Lloyd-Max centroid, norm
    correction in fp16; decoded as the README's bit-exact decode."""
    from pion import codecs as pc
    x = rows.cpu().numpy().astype(np.float32).reshape(-1, n)
    s1, s2 = pc.sign_vector(pc.SIGN_SEED_1, n), pc.sign_vector(pc.SIGN_SEED_2, n)
    table = np.array(pc.CENTROID_BITS[bits], dtype=np.uint32).view(np.float32)
    norm = np.sqrt((x * x).sum(-1, dtype=np.float32))[:, None]
    inv = np.where(norm > 0, np.float32(1) / np.where(norm > 0, norm, 1), 0).astype(np.float32)
    t = (pc.fwht(x * s1) * s2) * inv
    half = 1 << (bits - 1)
    count = (np.abs(t)[..., None] >= (table[half:-1] + table[half + 1:]) / 2).sum(-1)
    c = table[np.where(t < 0, half - 1 - count, half + count)]
    cnorm = np.sqrt((c * c).sum(-1, dtype=np.float32))[:, None]
    s = np.minimum(norm / cnorm * np.float32(np.sqrt(n)), 65504).astype(np.float16)
    k = np.where(norm > 0, s.astype(np.float32), 0) * np.float32(1.0 / n)
    out = (pc.fwht(c * s2) * k) * s1
    return torch.from_numpy(out.astype(np.float32).reshape(rows.shape)).to(rows.device)


def codec_round_trip(x, codec):
    """[B, H, T, D] K or V rounded to a V-store codec (fp16, int8, turbo4/3/2)."""
    rows, (b, h, t, d) = _token_rows(x)
    if codec == "fp16":
        out = rows.half().float()
    elif codec == "int8":
        out = _int8_rows(rows)
    else:
        out = _turbo_rows(rows, int(codec[-1]))
    return out.reshape(b, t, h, d).permute(0, 2, 1, 3).to(x.dtype)


@pytest.mark.parametrize("codec", ["fp16", "int8", "turbo4"])
def test_lossy_codecs_first_token_and_logit_error(server, codec):
    model = llama(0)
    want, _miss, hit, diff = check_exact(model, client_for(server), codec=codec,
                                         label="llama fp32, lossy")
    prefix, suffix = prompt(1, 96), prompt(2, 8)
    full = torch.cat([prefix, suffix])
    want_logits = suffix_logits(model, full, 96)
    with torch.no_grad():
        own = model(input_ids=prefix[None].to(DEV), use_cache=True).past_key_values
    rounded = map_cache(own, lambda x: codec_round_trip(x, codec))
    ref_rel = logit_rel_err(suffix_logits(model, full, 96, rounded), want_logits)
    ref_tokens = generate(model, full, map_cache(
        model(input_ids=prefix[None].to(DEV), use_cache=True).past_key_values,
        lambda x: codec_round_trip(x, codec)))
    pc = pion.hf.PionPromptCache(model, client_for(server), codec=codec)
    rel = logit_rel_err(suffix_logits(model, full, 96, pc.fetch(prefix)), want_logits)
    bound = LOSSY_LOGIT_SLACK * ref_rel + 1e-3
    print("\nllama fp32, %s cache: logit rel err %.3g (torch's rounding %.3g, bound %.3g), "
          "tokens %d/%d (the rounding's %d/%d), first %s (exact %d, rounding %d)" % (
              codec, rel, ref_rel, bound, sum(a == b for a, b in zip(want, hit)), NEW,
              sum(a == b for a, b in zip(want, ref_tokens)), NEW, hit[0], want[0],
              ref_tokens[0]))
    assert len(hit) == NEW and np.isfinite(diff)
    assert hit[0] in (want[0], ref_tokens[0])  # the exact model's, or the codec's own rounding's
    assert 0 < ref_rel and rel <= bound


# Pion's fp8 cache against the same model with its prefix K/V rounded to fp8 by torch (an
# independent encoder: each token's K or V row over all heads scaled by amax/448, cast to
# float8_e4m3fn and back, as the codec README specifies): at most this much further from the
# uncached logits than torch's own rounding (a tiny random model: the rounding alone moves
# its logits by ~0.14 of their spread, and the tokens with them).
FP8_LOGIT_SLACK = 1.05


# codec -> (torch dtype name, its largest finite value): fp8 is e4m3fn, fp8_e5m2 e5m2.
FP8_CODECS = {"fp8": ("float8_e4m3fn", 448.0), "fp8_e5m2": ("float8_e5m2", 57344.0)}


def fp8_round_trip(x, codec="fp8"):
    """[B, H, T, D] K or V rounded to the codec's fp8 with one scale per token (over H, D)."""
    name, top = FP8_CODECS[codec]
    amax = x.abs().amax(dim=(1, 3), keepdim=True).float()
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    q = (x.float() / scale).to(getattr(torch, name)).float() * scale
    return q.to(x.dtype)


def map_cache(cache, fn):
    """Applies fn to every layer's K and V of a transformers cache (either cache API)."""
    if hasattr(cache, "layers"):
        for layer in cache.layers:
            layer.keys, layer.values = fn(layer.keys), fn(layer.values)
    else:
        for i in range(len(cache.key_cache)):
            cache.key_cache[i] = fn(cache.key_cache[i])
            cache.value_cache[i] = fn(cache.value_cache[i])
    return cache


def logit_rel_err(got, want) -> float:
    """RMS of the logit error over the RMS spread of the reference logits (per position)."""
    spread = (want - want.mean(dim=-1, keepdim=True)).pow(2).mean().sqrt()
    return ((got - want).pow(2).mean().sqrt() / spread).item()


@pytest.mark.parametrize("codec", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("transport", ["auto", "ipc"])
def test_fp8_prompt_cache_agreement_and_logit_error(server, transport, codec):
    if transport == "ipc" and DEV != "cuda":
        pytest.skip("CUDA IPC needs a GPU")
    client = ipc_client(server) if transport == "ipc" else client_for(server)
    model = llama(0)
    prefix, suffix = prompt(1, 96), prompt(2, 8)
    full = torch.cat([prefix, suffix])
    want = generate(model, full)
    want_logits = suffix_logits(model, full, 96)
    # The reference: transformers' own cache of the prefix, rounded to fp8 by torch.
    with torch.no_grad():
        own = model(input_ids=prefix[None].to(DEV), use_cache=True).past_key_values
    ref_rel = logit_rel_err(
        suffix_logits(model, full, 96, map_cache(own, lambda x: fp8_round_trip(x, codec))),
        want_logits)
    pc = pion.hf.PionPromptCache(model, client, codec=codec, transport=transport)
    pc.get_or_prefill(prefix)
    assert pc.last["hit"] is False
    pc2 = pion.hf.PionPromptCache(model, client, codec=codec, transport=transport)
    got = generate(model, full, pc2.get_or_prefill(prefix))
    assert pc2.last["hit"] is True
    rel1 = logit_rel_err(suffix_logits(model, full, 96, pc2.fetch(prefix)), want_logits)
    agree1 = sum(a == b for a, b in zip(want, got))
    # Stage 2: the attention layers computed in the server over slots bound from the fp8
    # namespaces (fp8: the slots keep the e4m3 bytes; fp8_e5m2 namespaces decode to fp32).
    off = pion.hf.PionAttentionOffload(pc2)
    try:
        cache = off.prepare(prefix)
        with off.session(cache):
            got2 = generate(model, full, cache)
        cache = off.prepare(prefix)
        with off.session(cache):
            rel2 = logit_rel_err(suffix_logits(model, full, 96, cache), want_logits)
    finally:
        model.set_attn_implementation("sdpa")
    base = pc2.namespace_for(prefix)
    dtypes = {m["dtype"] for g in pc2.plan.groups
              for m in client.attend.info(pc2._slot_sid(base, g))}
    agree2 = sum(a == b for a, b in zip(want, got2))
    bound = FP8_LOGIT_SLACK * ref_rel + 1e-3
    print("\nllama fp32, %s cache (%s): stage 1 logit rel err %.3g, tokens %d/%d; stage 2 "
          "(slots %s) logit rel err %.3g, tokens %d/%d; torch's %s rounding of the exact "
          "cache %.3g (bound %.3g)" % (codec, transport, rel1, agree1, NEW, sorted(dtypes),
                                       rel2, agree2, NEW, FP8_CODECS[codec][0], ref_rel, bound))
    assert dtypes == ({"fp8"} if codec == "fp8" else {"fp32"})
    assert got[0] == want[0] and got2[0] == want[0]
    assert 0 < ref_rel and rel1 <= bound and rel2 <= bound


def test_stale_identity_misses(server):
    client = client_for(server)
    a, b = llama(0), llama(1)  # same config, other weights
    assert pion.hf.model_identity(a) != pion.hf.model_identity(b)
    prefix = prompt(1, 64)
    pa = pion.hf.PionPromptCache(a, client)
    pa.get_or_prefill(prefix)
    pb = pion.hf.PionPromptCache(b, client)
    assert not pb.lookup(prefix, namespace=pa.namespace_for(prefix))
    assert pb.fetch(prefix, namespace=pa.namespace_for(prefix)) is None
    pb.get_or_prefill(prefix)
    assert pb.last["hit"] is False
    assert pa.fetch(prefix) is not None  # a's prefix is untouched


def test_restart_between_store_and_hit(pion_factory, tmp_path):
    data = tmp_path / "disk"
    srv = pion_factory("--workers", "2", "--dir", str(data))
    model = llama(0)
    prefix, suffix = prompt(3, 80), prompt(4, 8)
    full = torch.cat([prefix, suffix])
    pc = pion.hf.PionPromptCache(model, client_for(srv), persist=True)
    pc.get_or_prefill(prefix)
    srv.stop()
    srv2 = pion_factory("--workers", "2", "--dir", str(data))
    pc2 = pion.hf.PionPromptCache(model, client_for(srv2))
    cache = pc2.get_or_prefill(prefix)
    assert pc2.last["hit"] is True
    assert generate(model, full, cache) == generate(model, full)


def test_stage2_attention_offload_exact(server):
    model = llama(0)
    prefix, suffix = prompt(1, 96), prompt(2, 8)
    full = torch.cat([prefix, suffix])
    want = generate(model, full)
    want_logits = suffix_logits(model, full, 96)
    pc = pion.hf.PionPromptCache(model, client_for(server))
    off = pion.hf.PionAttentionOffload(pc)
    try:
        cache = off.prepare(prefix)
        with off.session(cache):
            got = generate(model, full, cache)
        cache = off.prepare(prefix)  # a hit: the slots are bound again, nothing prefilled
        assert pc.last["stage"] == 2
        with off.session(cache):
            logits = suffix_logits(model, full, 96, cache)
        diff = (logits - want_logits).abs().max().item()
        print("\nstage 2 llama fp32: max|logit diff| %.3g, tokens %d/%d" % (
            diff, sum(a == b for a, b in zip(want, got)), NEW))
        assert got == want
        assert diff < 1e-3
    finally:
        model.set_attn_implementation("sdpa")


def test_stage2_sparse_auto_decode(server):
    """SparseAuto: decode steps of the offloaded layers go to QUERY_SPARSE_AUTO_FUSED. A budget
    that covers every block is exact (the generation equals vanilla's, receipts say exact);
    1/4 of the blocks attends a subset (receipts not exact, blocks named, the estimate in
    [0, 1]) and every call is observed; the prompt's several positions stay exact."""
    model = llama(0)
    prefix, suffix = prompt(1, 512), prompt(2, 8)
    full = torch.cat([prefix, suffix])
    want = generate(model, full)
    pc = pion.hf.PionPromptCache(model, client_for(server))
    try:
        for budget, exact in ((1.0, True), (0.25, False)):
            seen = []
            sp = pion.hf.SparseAuto(block_size=64, budget=budget, select="quest", receipts=[],
                                    observe=lambda li, q, k, v, r: seen.append((li, q.shape)))
            off = pion.hf.PionAttentionOffload(pc, sparse=sp)
            cache = off.prepare(prefix)
            with off.session(cache):
                got = generate(model, full, cache)
            off.release(cache)
            # NEW tokens: the first comes from the prompt's pass (exact), the others from
            # NEW - 1 decode steps of each of the model's 4 layers.
            assert len(sp.receipts) == len(seen) == 4 * (NEW - 1)
            assert {li for li, _ in seen} == {0, 1, 2, 3}
            assert all(shape == (8, 64) for _, shape in seen)
            for _, rc in sp.receipts:
                assert rc["form"] == "sparse_auto_fused" and rc["exact"] is exact
                assert 0.0 <= rc["omitted_mass_estimate"] <= 1.0
                assert len(rc["blocks"]) == 8
                assert all(len(b) == (8 if exact else 2 + sp.k_top(512)) for b in rc["blocks"])
            if exact:
                assert got == want
            else:
                assert got[0] == want[0]
    finally:
        model.set_attn_implementation("sdpa")


@pytest.mark.parametrize("shm", [False, True], ids=["tcp", "shm"])
def test_layerwise_warm_start_exact(server, shm):
    """layerwise=True: the hit's layers arrive while the forward runs; the generation and the
    suffix logits are those of the whole-cache fetch."""
    model = llama(0)
    client = client_for(server, shm)
    prefix, suffix = prompt(1, 96), prompt(2, 8)
    full = torch.cat([prefix, suffix])
    want = generate(model, full)
    pion.hf.PionPromptCache(model, client).get_or_prefill(prefix)  # the miss stores it
    pc = pion.hf.PionPromptCache(model, client, layerwise=True)
    got = generate(model, full, pc.get_or_prefill(prefix))
    assert pc.last["hit"] is True and got == want
    whole = pion.hf.PionPromptCache(model, client).fetch(prefix)
    diff = (suffix_logits(model, full, 96, whole) -
            suffix_logits(model, full, 96, pc.fetch(prefix))).abs().max().item()
    assert diff == 0.0


def test_tp_rank_fetches_only_its_heads(server):
    """tp_rank / tp_size: each rank's cache holds its share of the K/V heads, byte-exact."""
    model = llama(0)  # 2 K/V heads
    client = client_for(server)
    prefix = prompt(3, 96)
    pion.hf.PionPromptCache(model, client).get_or_prefill(prefix)
    whole = pion.hf.PionPromptCache(model, client).fetch(prefix)
    for rank in range(2):
        part = pion.hf.PionPromptCache(model, client, tp_rank=rank, tp_size=2).fetch(prefix)
        for i, layer in enumerate(whole.layers):
            assert torch.equal(part.layers[i].keys, layer.keys[:, rank:rank + 1])
            assert torch.equal(part.layers[i].values, layer.values[:, rank:rank + 1])
