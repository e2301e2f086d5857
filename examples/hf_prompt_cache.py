#!/usr/bin/env python3
"""A Hugging Face transformers model with its prompt cache in Pion.

Stage 1: the K/V of a shared prefix are prefilled once, stored in Pion, and fetched by any
later request (any process) instead of being recomputed. Stage 2 (--stage2): the prefix K/V
stay in Pion and its attention is computed there, exact.

Needs torch and transformers (pip) and a running pion-server:
    build/pion-server --unixsocket /tmp/pion.sock                # TCP 1974 + shared memory
    python3 examples/hf_prompt_cache.py                           # TCP
    python3 examples/hf_prompt_cache.py --unix /tmp/pion.sock    # same host: shared memory
    python3 examples/hf_prompt_cache.py --model /path/to/llama   # a local checkpoint
Without --model a small random-weight Llama is built from a config (nothing is downloaded).
On a GPU with the server's --attention-backend cuda, --transport ipc reads the prefix from the
server's GPU slots (CUDA IPC: aliased when they hold the model's dtype, else copied device to
device) instead of through host memory.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python"))

import torch  # noqa: E402
import transformers  # noqa: E402

import pion  # noqa: E402
import pion.hf  # noqa: E402


def load_model(path: str | None, device: str):
    if path:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype="auto")
    else:
        cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                                       num_hidden_layers=4, num_attention_heads=8,
                                       num_key_value_heads=2, max_position_embeddings=4096)
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(device).eval()
    model.generation_config.pad_token_id = model.generation_config.eos_token_id or 0
    return model


def generate(model, ids, cache=None, n=24):
    with torch.no_grad():
        out = model.generate(input_ids=ids[None].to(model.device), past_key_values=cache,
                             attention_mask=torch.ones(1, ids.numel(), dtype=torch.long,
                                                       device=model.device),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, ids.numel():].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=1974)
    ap.add_argument("--unix", help="the server's --unixsocket path (shared-memory transport)")
    ap.add_argument("--model", help="a local transformers checkpoint (default: random Llama)")
    ap.add_argument("--prefix", type=int, default=512, help="prefix tokens")
    ap.add_argument("--transport", default="auto", choices=("auto", "ipc"))
    ap.add_argument("--stage2", action="store_true", help="also run Stage 2 (attention in Pion)")
    a = ap.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(a.model, device)
    client = pion.Client(unix_socket_path=a.unix) if a.unix else pion.Client(a.host, a.port)
    g = torch.Generator().manual_seed(1)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prefix = torch.randint(5, vocab, (a.prefix,), generator=g)  # e.g. a long system prompt
    question = torch.randint(5, vocab, (16,), generator=g)
    full = torch.cat([prefix, question])

    # --- Stage 1: the prompt cache ------------------------------------------------------------
    pc = pion.hf.PionPromptCache(model, client, transport=a.transport)
    pc.drop(prefix)                                  # start cold (a demo; not needed in use)
    cache = pc.get_or_prefill(prefix)                # miss: prefill + store
    print("miss: prefilled in %.1f ms, stored %.1f MB in %.1f ms" % (
        pc.last["prefill_ms"], pc.last["bytes"] / 1e6, pc.last["store_ms"]))
    first = generate(model, full, cache)

    t0 = time.perf_counter()
    cache = pc.get_or_prefill(prefix)                # hit: filled from Pion
    print("hit: %.1f MB fetched in %.1f ms (path %s), request took %.1f ms" % (
        pc.last["bytes"] / 1e6, pc.last["fetch_ms"], pc.last["path"],
        (time.perf_counter() - t0) * 1e3))
    warm = generate(model, full, cache)
    vanilla = generate(model, full)
    print("greedy tokens equal vanilla: miss %s, hit %s" % (first == vanilla, warm == vanilla))

    # --- Stage 2: attention over the prefix computed in Pion ----------------------------------
    if a.stage2:
        off = pion.hf.PionAttentionOffload(pc)       # registers the "pion" attention
        try:
            cache = off.prepare(prefix)              # binds the prefix's slots in the server
            with off.session(cache):
                got = generate(model, full, cache)
            off.release(cache)
        finally:
            model.set_attn_implementation("sdpa")
        print("stage 2: greedy tokens equal vanilla: %s" % (got == vanilla))
    return 0 if warm == vanilla else 1


if __name__ == "__main__":
    sys.exit(main())
