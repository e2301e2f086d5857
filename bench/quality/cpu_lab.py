#!/usr/bin/env python3
"""The quality lab on the CPU backend (issue 55 §2, "the CPU backend on a subset"): the model
train.py made, run here in plain PyTorch (no transformers: Debian has none), with every decode
step's attention computed by a real pion-server (`--attention-backend cpu`).

The model is transformers' LlamaForCausalLM written out (RMSNorm, RoPE "default", GQA
attention, SwiGLU MLP, tied embeddings) over the checkpoint's bf16 weights, computed in fp32;
`--check` compares its held-out loss with the one train.py logged and its Stage 2 dense decode
with its own full forward.

Held-out text: this machine's Python packages split by train.corpus's rule (a file is held out
when the SHA-1 of its path is 0 mod 20 — held out on the GPU machine too, where the same path
existed; the rest of this machine's files the model never saw either way).

Sections (--sections, default all):
  sparse  each prefix's K/V (post-RoPE, fp32) stored as ATTEND.PREFIX slots; the continuation
          teacher-forced, every position a decode step whose offloaded layers call
          QUERY_FUSED (dense) or QUERY_SPARSE_AUTO_FUSED (SELECT mean/quest, per head or
          SHARED, blocks --blocks, budgets --budgets of the prefix's blocks; --policies: which
          layers stay dense) with RECEIPT. Per configuration: held-out perplexity delta against
          dense, and per call the true omitted softmax mass (from the query and the prefix's
          keys, the blocks the receipt names) against the receipt's omitted_mass_estimate and
          omitted_mass_bound, and the server's own AUDIT figure (omitted_mass_exact).
  codecs  Stage 1: the prefix's K/V stored in a KV.PREFIX namespace of every codec, fetched
          back decoded, and the continuation computed over them locally: perplexity delta
          against bf16 and bytes per token.
  needles passkeys (four keys in --needle-prefix bytes of held-out text, the asked one at each
          depth): the question fed and seven digits decoded greedily a decode step at a time
          through Stage 2, dense and in every sparse mode at --needle-budget — accuracy by depth.

Writes <out>/quality-cpu.json and <out>/quality-cpu.md.

    /usr/bin/python3 bench/quality/cpu_lab.py --ckpt bench/quality/out --out /tmp/cpu-lab
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "clients" / "python"))
import train  # noqa: E402
from benchutil import cpu_model  # noqa: E402
from eval import mass_columns, oracle_omitted  # noqa: E402

CODECS = ["fp32", "bf16", "fp16", "fp8", "fp8_e5m2", "int8", "turbo4", "turbo3", "turbo2"]


# ---- the checkpoint ---------------------------------------------------------------------------
def read_safetensors(path: Path) -> dict:
    """{name: float32 numpy array} of one safetensors file (BF16, F16 or F32 tensors)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    base = 8 + n
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        s, e = t["data_offsets"]
        buf = raw[base + s:base + e]
        if t["dtype"] == "BF16":
            a = (np.frombuffer(buf, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif t["dtype"] == "F16":
            a = np.frombuffer(buf, np.float16).astype(np.float32)
        elif t["dtype"] == "F32":
            a = np.frombuffer(buf, np.float32).copy()
        else:
            raise ValueError("%s: tensor %s has dtype %s" % (path, name, t["dtype"]))
        out[name] = a.reshape(t["shape"])
    return out


class Llama:
    """LlamaForCausalLM's forward in plain torch (fp32), over train.py's checkpoint."""

    def __init__(self, ckpt: Path, threads: int):
        import torch
        torch.set_num_threads(threads)
        self.torch = torch
        cfg = json.loads((ckpt / "config.json").read_text())
        self.cfg = cfg
        self.layers = cfg["num_hidden_layers"]
        self.hq, self.hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        self.d = cfg.get("head_dim") or cfg["hidden_size"] // self.hq
        self.eps = cfg["rms_norm_eps"]
        theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.d, 2, dtype=torch.float64) /
                                         self.d))
        w = {}
        for f in sorted(ckpt.glob("model-*.safetensors")):
            w.update({k: torch.from_numpy(v) for k, v in read_safetensors(f).items()})
        self.w = w
        self.embed = w["model.embed_tokens.weight"]
        self.head = w.get("lm_head.weight", self.embed)  # tied

    def _norm(self, x, weight):
        x = x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * weight

    def _rope(self, x, pos):
        """x [H, T, D] at positions pos [T]: HF's rotate_half convention."""
        torch = self.torch
        f = torch.outer(pos.to(torch.float64), self.inv_freq)
        emb = torch.cat([f, f], -1)
        cos, sin = emb.cos().float(), emb.sin().float()
        h = self.d // 2
        rot = torch.cat([-x[..., h:], x[..., :h]], -1)
        return x * cos + rot * sin

    def qkv(self, i: int, x, pos):
        """Layer i's queries [Hq, T, D], keys and values [Hkv, T, D] (post-RoPE) of hidden
        states x [T, hidden] at positions pos [T]."""
        p = "model.layers.%d." % i
        h = self._norm(x, self.w[p + "input_layernorm.weight"])
        t = x.shape[0]
        q = (h @ self.w[p + "self_attn.q_proj.weight"].T).view(t, self.hq, self.d).transpose(0, 1)
        k = (h @ self.w[p + "self_attn.k_proj.weight"].T).view(t, self.hkv, self.d)
        v = (h @ self.w[p + "self_attn.v_proj.weight"].T).view(t, self.hkv, self.d)
        return self._rope(q, pos), self._rope(k.transpose(0, 1), pos), v.transpose(0, 1)

    def finish(self, i: int, x, attn):
        """Residual, MLP and residual of layer i; attn [T, Hq*D]."""
        p = "model.layers.%d." % i
        x = x + attn @ self.w[p + "self_attn.o_proj.weight"].T
        h = self._norm(x, self.w[p + "post_attention_layernorm.weight"])
        g = h @ self.w[p + "mlp.gate_proj.weight"].T
        u = h @ self.w[p + "mlp.up_proj.weight"].T
        return x + (self.torch.nn.functional.silu(g) * u) @ self.w[p + "mlp.down_proj.weight"].T

    def logits(self, x):
        return self._norm(x, self.w["model.norm.weight"]) @ self.head.T

    def attend(self, q, k, v, q_pos0: int):
        """Causal GQA attention of q [Hq, T, D] at positions q_pos0.. over k/v [Hkv, N, D] at
        0..N-1, in query chunks: [T, Hq*D]."""
        torch = self.torch
        g = self.hq // self.hkv
        ke, ve = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)
        out = []
        kpos = torch.arange(k.shape[1])
        for a in range(0, q.shape[1], 512):
            qc = q[:, a:a + 512]
            s = (qc @ ke.transpose(1, 2)) / math.sqrt(self.d)
            qpos = torch.arange(q_pos0 + a, q_pos0 + a + qc.shape[1])
            s = s.masked_fill(kpos[None, None, :] > qpos[None, :, None], float("-inf"))
            out.append(torch.softmax(s, -1) @ ve)
        return torch.cat(out, 1).transpose(0, 1).reshape(q.shape[1], -1)

    def prefill(self, ids):
        """(per-layer (K, V) [Hkv, N, D], logits [N, vocab]) of a whole sequence."""
        torch = self.torch
        with torch.no_grad():
            pos = torch.arange(len(ids))
            x = self.embed[ids]
            kv = []
            for i in range(self.layers):
                q, k, v = self.qkv(i, x, pos)
                kv.append((k.contiguous(), v.contiguous()))
                x = self.finish(i, x, self.attend(q, k, v, 0))
            return kv, self.logits(x)


# ---- the lab ----------------------------------------------------------------------------------
def start_server(binary: Path):
    """pion-server (CPU backend) on a free port and a Unix socket: (process, its directory,
    a client on the socket)."""
    import tempfile
    from benchutil import start_pion
    import pion
    sock_dir = Path(tempfile.mkdtemp(prefix="pion-cpu-lab-sock-"))
    proc, _, work = start_pion(str(binary), ["--binary-port", "0", "--unixsocket",
                                             str(sock_dir / "pion.sock"), "--attention-backend",
                                             "cpu", "--workers", "2", "--maxmemory", "8gb"],
                               prefix="pion-cpu-lab-")
    return proc, [work, sock_dir], pion.Client(unix_socket_path=str(sock_dir / "pion.sock"),
                                               socket_timeout=300)


def parse_policies(text: str) -> list[tuple[str, tuple[int, ...]]]:
    """"none,0-1" -> [("none", ()), ("0-1", (0, 1))]: the layers kept dense."""
    out = []
    for part in text.split(","):
        part = part.strip()
        if part in ("", "none"):
            out.append(("none", ()))
        elif "-" in part:
            a, b = part.split("-")
            out.append((part, tuple(range(int(a), int(b) + 1))))
        else:
            out.append((part, tuple(int(x) for x in part.split("+"))))
    return out


class Case:
    """One held-out sequence: prefix ids, continuation ids, the prefix's K/V and the logits
    of the full forward."""

    def __init__(self, model: Llama, held: np.ndarray, i: int, prefix: int, cont: int):
        torch = model.torch
        rnd = random.Random(1000 + i)
        s = rnd.randrange(0, len(held) - prefix - cont - 1)
        ids = torch.tensor(held[s:s + prefix + cont].astype(np.int64))
        self.prefix, self.cont = ids[:prefix], ids[prefix:]
        t0 = time.perf_counter()
        self.kv, full = model.prefill(ids)
        self.prefill_s = time.perf_counter() - t0
        # The prefix's K/V: the first `prefix` rows of the whole sequence's.
        self.kv = [(k[:, :prefix].contiguous(), v[:, :prefix].contiguous()) for k, v in self.kv]
        self.full_logits = full[prefix - 1:-1]  # predicting cont[0..]


def decode(model: Llama, case: Case, attend):
    """Teacher-forced decode of the continuation: the token before each position is fed as one
    decode step (its keys appended to the local suffix), and each layer's attention is
    attend(layer, q [Hq, D], k_suf [Hkv, S, D], v_suf) -> [Hq, D]. Returns logits [cont, vocab]
    predicting cont[0..]."""
    torch = model.torch
    n = len(case.prefix)
    feed = torch.cat([case.prefix[-1:], case.cont[:-1]])
    # The last prefix token is already in the prefix's K/V: the first step re-feeds it as the
    # query at position n-1 over rows 0..n-2 would; simpler and exact: its logits are the full
    # forward's, and decode starts at position n with cont[0].
    out = [case.full_logits[0]]
    suffix = [([], []) for _ in range(model.layers)]
    with torch.no_grad():
        for t in range(1, len(feed)):
            out.append(step(model, feed[t], n + t - 1, suffix, attend))
    return torch.stack(out)


def step(model: Llama, tok, pos: int, suffix, attend):
    """One decode step: token tok at position pos, its keys and values appended to each
    layer's local suffix (lists of [Hkv, 1, D]), each layer's attention
    attend(layer, q [Hq, D], k_suf, v_suf) -> [Hq, D]. Returns the logits [vocab]."""
    torch = model.torch
    x = model.embed[tok][None]
    p = torch.tensor([pos])
    for i in range(model.layers):
        q, k, v = model.qkv(i, x, p)
        suffix[i][0].append(k)
        suffix[i][1].append(v)
        a = attend(i, q[:, 0], torch.cat(suffix[i][0], 1), torch.cat(suffix[i][1], 1))
        x = model.finish(i, x, a.reshape(1, -1))
    return model.logits(x)[0]


def nll(model, logits, targets) -> float:
    return model.torch.nn.functional.cross_entropy(logits, targets).item()


class Omitted:
    """The true omitted softmax mass of a sparse call: softmax over the prefix's keys and the
    local suffix, the prefix rows of the blocks the receipt does not name."""

    def __init__(self, model: Llama, case: Case, block: int):
        self.model, self.case, self.block = model, case, block
        self.rows = []  # (true mean over heads, estimate, bound, the server's audit, oracle)

    def __call__(self, layer, q, ks, vs, receipt):
        torch, m = self.model.torch, self.model
        g = m.hq // m.hkv
        kp = self.case.kv[layer][0].repeat_interleave(g, 0)  # [Hq, P, D]
        kse = ks.repeat_interleave(g, 0)
        sp = torch.einsum("hd,hpd->hp", q.double(), kp.double()) / math.sqrt(m.d)
        ss = torch.einsum("hd,hsd->hs", q.double(), kse.double()) / math.sqrt(m.d)
        lse = torch.logsumexp(torch.cat([sp, ss], 1), 1, keepdim=True)
        pp = torch.exp(sp - lse)
        nb = -(-pp.shape[1] // self.block)
        pad = nb * self.block - pp.shape[1]
        bm = torch.nn.functional.pad(pp, (0, pad)).view(m.hq, nb, self.block).sum(-1)
        kept = torch.zeros(m.hq, nb, dtype=torch.float64)
        for h, blocks in enumerate(receipt["blocks"]):
            kept[h, list(blocks)] = 1
        true = (bm * (1 - kept)).sum(-1).mean().item()
        self.rows.append((true, float(receipt["omitted_mass_estimate"]),
                          float(receipt["omitted_mass_bound"]),
                          float(receipt["omitted_mass_exact"]),
                          oracle_omitted(torch, bm, [len(b) for b in receipt["blocks"]])))


class Profile:
    """Where a dense decode step's attention mass lies, per layer: the local suffix, the last
    64 / 256 / 1024 prefix rows, the first 64 (the sink), the rest of the prefix."""
    SPANS = ("suffix", "last64", "last256", "last1024", "first64")

    def __init__(self, model: Llama, case: Case):
        self.model, self.case = model, case
        self.mass = [[] for _ in range(model.layers)]

    def __call__(self, layer, q, ks, vs):
        torch, m = self.model.torch, self.model
        g = m.hq // m.hkv
        kp = self.case.kv[layer][0].repeat_interleave(g, 0).double()
        kse = ks.repeat_interleave(g, 0).double()
        s = torch.cat([torch.einsum("hd,hpd->hp", q.double(), kp),
                       torch.einsum("hd,hsd->hs", q.double(), kse)], 1) / math.sqrt(m.d)
        p = torch.softmax(s, 1)  # [Hq, P + S]
        n = kp.shape[1]
        pre = p[:, :n]
        self.mass[layer].append([p[:, n:].sum(1).mean().item()] +
                                [pre[:, max(0, n - w):].sum(1).mean().item()
                                 for w in (64, 256, 1024)] +
                                [pre[:, :64].sum(1).mean().item()])


def section_sparse(model: Llama, client, cases: list[Case], args) -> dict:
    torch = model.torch
    out = {"check": [], "rows": []}
    for ci, case in enumerate(cases):
        for i, (k, v) in enumerate(case.kv):
            client.attend.store("lab%d" % ci, i, k.numpy(), v.numpy())

    def dense_attend(ci, profile=None):
        def f(layer, q, ks, vs):
            if profile is not None:
                profile(layer, q, ks, vs)
            r = client.attend.query_fused("lab%d" % ci, layer, q[:, None].numpy(), ks.numpy(),
                                          vs.numpy())
            return torch.from_numpy(np.asarray(r.out, np.float32).reshape(q.shape).copy())
        return f

    dense_nll, dense_logits = [], []
    profiles = []
    for ci, case in enumerate(cases):
        t0 = time.perf_counter()
        profiles.append(Profile(model, case))
        lg = decode(model, case, dense_attend(ci, profiles[-1]))
        dense_logits.append(lg)
        dense_nll.append(nll(model, lg, case.cont))
        # Stage 2 dense is the model: the decode's logits against the full forward's.
        diff = (lg - case.full_logits).abs().max().item()
        agree = (lg.argmax(-1) == case.full_logits.argmax(-1)).float().mean().item()
        out["check"].append({"seq": ci, "max_dlogit_vs_full_forward": diff, "agree": agree,
                             "nll_full": nll(model, case.full_logits, case.cont),
                             "nll_stage2_dense": dense_nll[-1],
                             "seconds": time.perf_counter() - t0})
        print("dense seq %d: max |dlogit| vs full forward %.2e, agree %.3f, nll %.4f (%.1f s)"
              % (ci, diff, agree, dense_nll[-1], time.perf_counter() - t0), flush=True)
    base = float(np.mean(dense_nll))
    out["profile"] = [dict(zip(Profile.SPANS, np.mean(sum((p.mass[i] for p in profiles), []),
                                                      0).tolist()))
                      for i in range(model.layers)]
    selects = [(s.split("+")[0], s.endswith("+shared")) for s in args.selects.split(",")]
    configs = [(policy, dense_layers, block, sel, shared, b, rec)
               for policy, dense_layers in parse_policies(args.policies)
               for block in [int(x) for x in args.blocks.split(",")]
               for sel, shared in selects
               for b in [int(x) for x in args.budgets.split(",")]
               for rec in [int(x) for x in args.recents.split(",")]]
    for policy, dense_layers, block, sel, shared, b, rec in configs:
        nlls, probes = [], []
        t0 = time.perf_counter()
        for ci, case in enumerate(cases):
            blocks = -(-len(case.prefix) // block)
            k_top = max(0, int(math.ceil(blocks / b)) - 2)
            recent = min(rec, k_top)
            probe = Omitted(model, case, block)
            dense = dense_attend(ci)

            def f(layer, q, ks, vs, ci=ci, k_top=k_top, probe=probe, dense=dense,
                  recent=recent):
                if layer in dense_layers:
                    return dense(layer, q, ks, vs)
                r = client.attend.query_sparse_auto_fused(
                    "lab%d" % ci, layer, q.numpy(), ks.numpy(), vs.numpy(), block,
                    k_top, select=sel, shared=shared, receipt="audit", recent=recent)
                probe(layer, q, ks, vs, r.receipt)
                return torch.from_numpy(np.asarray(r.out, np.float32).copy())
            lg = decode(model, case, f)
            nlls.append(nll(model, lg, case.cont))
            probes += probe.rows
        t, e, u, x, o = mass_columns(probes)
        row = {"policy": policy, "block": block, "select": sel, "shared": shared,
               "recent": rec,
               "budget": "1/%d" % b, "nll": float(np.mean(nlls)),
               "ppl_delta_pct": 100 * (math.exp(np.mean(nlls) - base) - 1),
               "calls": len(t), "true_mean": float(t.mean()),
               "true_p95": float(np.percentile(t, 95)),
               "oracle_mean": float(o.mean()),
               "estimate_mean": float(e.mean()),
               "estimate_minus_true": [float((e - t).min()), float((e - t).max())],
               "estimate_within_0.02": float(np.mean(np.abs(e - t) <= 0.02)),
               "bound_mean": float(u.mean()),
               "bound_minus_true_mean": float((u - t).mean()),
               "bound_below_true": int((u < t - 1e-6).sum()),
               "audit_max_abs_diff": float(np.abs(x - t).max()),
               "seconds": time.perf_counter() - t0}
        out["rows"].append(row)
        print("sparse:", json.dumps(row), flush=True)
    out["nll_dense"] = base
    return out


DEPTHS = (0.05, 0.25, 0.5, 0.75, 0.95)


def section_needles(model: Llama, client, held: np.ndarray, args) -> dict:
    """Passkey accuracy by depth, dense and sparse: four keys planted in --needle-prefix bytes of
    held-out text, the one at the depth asked; the question fed a decode step at a time through
    Stage 2 (dense QUERY_FUSED, or each --selects/--policies/--recents mode at --needle-budget),
    then seven digits decoded greedily the same way."""
    torch = model.torch
    sel_modes = [(s.split("+")[0], s.endswith("+shared")) for s in args.selects.split(",")]
    modes = [("dense", None)] + [
        ("%s%s%s%s 1/%d" % (sel, " shared" if sh else "", " RECENT %d" % rec if rec else "",
                            " dense %s" % policy if dl else "", args.needle_budget),
         (sel, sh, rec, dl))
        for policy, dl in parse_policies(args.policies) for sel, sh in sel_modes
        for rec in [int(x) for x in args.recents.split(",")]]
    right = {name: {d: 0 for d in DEPTHS} for name, _ in modes}
    cases = 0
    for depth in DEPTHS:
        for i in range(args.needles):
            seq, q0, ans, digits = train.needle(held, args.needle_prefix, i, depth)
            ids = torch.tensor(seq.astype(np.int64))
            prefix, question = ids[:q0], ids[q0:ans]
            kv, _ = model.prefill(prefix)
            slot = "needle"
            for li, (k, v) in enumerate(kv):
                client.attend.store(slot, li, k.numpy(), v.numpy())
            blocks = -(-q0 // args.needle_block)
            k_top = max(0, int(math.ceil(blocks / args.needle_budget)) - 2)
            for name, mode in modes:
                def f(layer, q, ks, vs, mode=mode):
                    if mode is None or layer in mode[3]:
                        r = client.attend.query_fused(slot, layer, q[:, None].numpy(),
                                                      ks.numpy(), vs.numpy())
                        return torch.from_numpy(
                            np.asarray(r.out, np.float32).reshape(q.shape).copy())
                    r = client.attend.query_sparse_auto_fused(
                        slot, layer, q.numpy(), ks.numpy(), vs.numpy(), args.needle_block,
                        k_top, select=mode[0], shared=mode[1], recent=min(mode[2], k_top))
                    return torch.from_numpy(np.asarray(r.out, np.float32).copy())
                got = greedy_after(model, q0, question, 7, f)
                right[name][depth] += got == digits
            client.attend.drop(slot)
            cases += 1
            print("needle depth %.2f #%d: %s" % (depth, i, json.dumps(
                {n: right[n][depth] for n, _ in modes})), flush=True)
    return {"prefix": args.needle_prefix, "budget": "1/%d" % args.needle_budget,
            "block": args.needle_block, "per_depth": args.needles,
            "accuracy": {n: {"%.2f" % d: right[n][d] / args.needles for d in DEPTHS}
                         for n, _ in modes}}


def greedy_after(model: Llama, n: int, feed, n_new: int, attend) -> str:
    """Feeds `feed` one decode step at a time after a prefix of n rows, then decodes n_new
    tokens greedily; each layer's attention is attend(layer, q, k_suf, v_suf)."""
    suffix = [([], []) for _ in range(model.layers)]
    toks = feed.tolist()
    out = []
    with model.torch.no_grad():
        t = 0
        while len(out) < n_new:
            logits = step(model, toks[t] if t < len(toks) else out[-1], n + t, suffix, attend)
            if t >= len(toks) - 1:
                out.append(int(logits.argmax()))
            t += 1
    return bytes(out).decode("latin-1")


def section_codecs(model: Llama, client, cases: list[Case], args) -> dict:
    """Stage 1 in every codec: the prefix's K/V through a KV.PREFIX namespace and back, the
    continuation computed locally over them."""
    torch = model.torch
    rows = []
    ref = None
    for codec in args.codecs.split(","):
        nlls, bpt = [], None
        for ci, case in enumerate(cases):
            ns = "codec-%s-%d" % (codec, ci)
            n = len(case.prefix)
            client.kv.register(ns, model.layers, n, model.hkv, model.d, fmt=codec)
            got = []
            for i, (k, v) in enumerate(case.kv):  # noqa: B007
                client.kv.store_layer(ns, i, k.numpy(), v.numpy(), layout="hnd")
            for i in range(model.layers):
                k, v = client.kv.fetch_layer(ns, i, layout="hnd")
                got.append((torch.from_numpy(np.asarray(k, np.float32).copy()),
                            torch.from_numpy(np.asarray(v, np.float32).copy())))
            if bpt is None:  # K and V rows of every layer, as the codec stores them
                from pion import codecs
                bpt = 2 * model.layers * codecs.row_bytes(codec, model.hkv * model.d)

            def f(layer, q, ks, vs, got=got):
                k = torch.cat([got[layer][0], ks], 1)
                v = torch.cat([got[layer][1], vs], 1)
                return model.attend(q[:, None], k, v, k.shape[1] - 1)[0]
            lg = decode(model, case, f)
            nlls.append(nll(model, lg, case.cont))
            client.kv.drop(ns)
        row = {"codec": codec, "nll": float(np.mean(nlls)), "bytes_per_token": bpt}
        if codec == "bf16":
            ref = row["nll"]
        rows.append(row)
        print("codec:", json.dumps(row), flush=True)
    for row in rows:
        row["ppl_delta_vs_bf16_pct"] = (100 * (math.exp(row["nll"] - ref) - 1)
                                        if ref is not None else None)
    return {"rows": rows}


def report(res: dict, path: Path) -> None:
    lines = ["# Quality lab on the CPU backend (%s)" % res["date"], "",
             "Command: `%s` at %s on %s (%s); model: %s." % (
                 res["command"], res["commit"], res["machine"], res["cpu"], res["model"]), ""]
    if "heldout_loss" in res:
        lines += ["The model here (plain torch, fp32 over the bf16 weights) on this machine's held-out "
                  "text: %.4f nats/byte over 8 windows of %d bytes (train.py logged %.4f on the GPU "
                  "machine's held-out files)." % (res["heldout_loss"]["here"], res["args"]["prefix"],
                                                  res["heldout_loss"]["train_py"] or float("nan")),
                  ""]
    if "sparse" in res:
        s = res["sparse"]
        lines += ["## Stage 2 dense is the model", "",
                  "| seq | max abs Δlogit vs full forward | argmax agreement | NLL full | NLL "
                  "Stage 2 dense |", "|---|---:|---:|---:|---:|"]
        for c in s["check"]:
            lines.append("| %d | %.2e | %.3f | %.4f | %.4f |" % (
                c["seq"], c["max_dlogit_vs_full_forward"], c["agree"], c["nll_full"],
                c["nll_stage2_dense"]))
        if "profile" in s:
            lines += ["", "## Where dense decode attention lies (mean share of softmax mass)", "",
                      "| layer | suffix | last 64 prefix rows | last 256 | last 1024 | first 64 |",
                      "|---|---:|---:|---:|---:|---:|"]
            for i, p in enumerate(s["profile"]):
                lines.append("| %d | %.3f | %.3f | %.3f | %.3f | %.3f |" % (
                    i, p["suffix"], p["last64"], p["last256"], p["last1024"], p["first64"]))
        lines += ["", "## Sparse-auto decode against dense", "",
                  "| dense layers | B | select | RECENT | budget | ppl Δ | true omitted (mean, p95) | "
                  "oracle omitted (mean) | estimate mean | estimate − true (min, max) | within ±0.02 | bound mean | "
                  "bound − true (mean) | bound below true | AUDIT − true (max abs) | calls |",
                  "|---|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s["rows"]:
            lines.append("| %s | %d | %s%s | %d | %s | %+.2f %% | %.3f, %.3f | %s | %.3f | "
                         "%+.3f, %+.3f | "
                         "%.1f %% | %.3f | %+.3f | %d | %.1e | %d |" % (
                             r["policy"], r["block"], r["select"], " shared" if r["shared"]
                             else "", r.get("recent", 0), r["budget"], r["ppl_delta_pct"], r["true_mean"],
                             r["true_p95"], "%.3f" % r["oracle_mean"] if "oracle_mean" in r
                             else "-", r["estimate_mean"], r["estimate_minus_true"][0],
                             r["estimate_minus_true"][1], 100 * r["estimate_within_0.02"],
                             r["bound_mean"], r["bound_minus_true_mean"], r["bound_below_true"],
                             r["audit_max_abs_diff"], r["calls"]))
        lines.append("")
    if "codecs" in res:
        lines += ["## Stage 1 codecs (prefix K/V through KV.PREFIX and back)", "",
                  "| codec | bytes per token (all layers, K and V) | NLL | ppl Δ vs bf16 |",
                  "|---|---:|---:|---:|"]
        for r in res["codecs"]["rows"]:
            lines.append("| %s | %s | %.4f | %s |" % (
                r["codec"], "%.0f" % r["bytes_per_token"] if r["bytes_per_token"] else "?",
                r["nll"], "%+.3f %%" % r["ppl_delta_vs_bf16_pct"]
                if r["ppl_delta_vs_bf16_pct"] is not None else "-"))
        lines.append("")
    if "needles" in res:
        nd = res["needles"]
        lines += ["## Passkeys by depth (%d bytes before the question, %d a depth, block %d, "
                  "sparse at %s)" % (nd["prefix"], nd["per_depth"], nd["block"], nd["budget"]),
                  "", "| mode | " + " | ".join("%.2f" % d for d in DEPTHS) + " |",
                  "|---|" + "---:|" * len(DEPTHS)]
        for name, acc in nd["accuracy"].items():
            lines.append("| %s | " % name + " | ".join("%.2f" % acc["%.2f" % d] for d in DEPTHS)
                         + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=str(HERE / "out"))
    ap.add_argument("--bin", default=str(REPO / "build" / "pion-server"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--sections", default="sparse,codecs")
    ap.add_argument("--prefix", type=int, default=7680)
    ap.add_argument("--cont", type=int, default=96)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--blocks", default="16,64")
    ap.add_argument("--budgets", default="8,16")
    ap.add_argument("--selects", default="mean,mean+shared,quest,quest+shared")
    ap.add_argument("--recents", default="0",
                    help="RECENT blocks (before the last) always attended, per run: e.g. 0,4")
    ap.add_argument("--policies", default="none,0-1",
                    help="layers kept dense per run: none, a-b, or a+b+c")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--needles", type=int, default=2, help="passkeys per depth (needles)")
    ap.add_argument("--needle-prefix", type=int, default=4096,
                    help="the bytes before a passkey question (needles)")
    ap.add_argument("--needle-budget", type=int, default=16)
    ap.add_argument("--needle-block", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--check", action="store_true",
                    help="also the model's held-out loss over 8 windows of the context")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Llama(Path(args.ckpt), args.threads)
    _, held, info = train.corpus(train.package_roots(), 40 << 20)
    print("held-out text: %d files, %d bytes" % (info["heldout_files"], len(held)), flush=True)
    res = {"date": dt.date.today().isoformat(), "command": " ".join(sys.argv),
           "machine": "%s, %d CPUs" % (platform.node(), os.cpu_count()), "cpu": cpu_model(),
           "model": "%s (%d layers, %d/%d heads of %d; trained %s steps on %s)" % (
               args.ckpt, model.layers, model.hq, model.hkv, model.d,
               model.cfg.get("pion_quality", {}).get("steps_done"),
               model.cfg.get("pion_quality", {}).get("device")),
           "args": vars(args), "heldout": info}
    try:
        res["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                       capture_output=True, text=True).stdout.strip()
    except OSError:
        res["commit"] = "?"
    if args.check:
        losses = []
        for i in range(8):
            rnd = random.Random(5000 + i)
            s = rnd.randrange(0, len(held) - args.prefix - 1)
            ids = model.torch.tensor(held[s:s + args.prefix + 1].astype(np.int64))
            _, lg = model.prefill(ids[:-1])
            losses.append(nll(model, lg, ids[1:]))
        trained = model.cfg.get("pion_quality", {}).get("final", {}).get("heldout_loss")
        res["heldout_loss"] = {"here": float(np.mean(losses)), "train_py": trained}
        print("held-out loss here %.4f nats/byte (train.py logged %s)" % (
            np.mean(losses), trained), flush=True)
    t0 = time.perf_counter()
    sections = args.sections.split(",")
    cases = ([Case(model, held, i, args.prefix, args.cont) for i in range(args.seqs)]
             if {"sparse", "codecs"} & set(sections) else [])
    print("prefill of %d sequences: %.1f s" % (len(cases), time.perf_counter() - t0), flush=True)
    proc, dirs, client = start_server(Path(args.bin))
    try:
        if "sparse" in sections:
            res["sparse"] = section_sparse(model, client, cases, args)
            (out / "quality-cpu.json").write_text(json.dumps(res, indent=1))
        if "codecs" in sections:
            res["codecs"] = section_codecs(model, client, cases, args)
            (out / "quality-cpu.json").write_text(json.dumps(res, indent=1))
        if "needles" in sections:
            res["needles"] = section_needles(model, client, held, args)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    (out / "quality-cpu.json").write_text(json.dumps(res, indent=1))
    report(res, out / "quality-cpu.md")
    print((out / "quality-cpu.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
