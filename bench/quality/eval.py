#!/usr/bin/env python3
"""The quality lab's evaluation (issue 55 §2): the model train.py made, through a real
pion-server, on held-out text and passkeys it never saw.

Sections (--sections, default all):
  exact   Stage 1 (the prefix's K/V stored in Pion and fetched back, bf16: lossless for this bf16
          model) and Stage 2 dense (the prefix's attention computed in Pion, QUERY_FUSED) against
          the model's own cache: max |Δlogit| and argmax agreement over the continuation.
  sparse  Stage 2 decode steps over a block selection (ATTEND.PREFIX.QUERY_SPARSE_AUTO_FUSED:
          SELECT mean / quest, per head / SHARED) at budgets 1/4 … 1/32 of the prefix's blocks:
          held-out perplexity of the continuation (teacher-forced, every position a decode step)
          against Stage 2 dense; passkey accuracy by depth (the question fed token by token, the
          seven digits greedy) against dense; and per call the true omitted softmax mass —
          computed densely from the query, the model's own prefix keys and the blocks the
          receipt names — against the receipt's `omitted_mass_estimate` (a proxy) and
          `omitted_mass_bound` (never below it).
  codecs  Stage 1 through PionPromptCache in every K/V codec: perplexity delta against bf16 and
          passkey accuracy, against the stored bytes per token.

Writes <out>/quality.json and <out>/quality.md (and PNGs where matplotlib exists; otherwise
`eval.py --plot <out>/quality.json` draws them on any machine that has it).

On the GPU machine (server-only bundle + the checkpoint carried):
    python3 build/devcarry/unpack.py
    LD_LIBRARY_PATH=$PWD/build/devcarry/lib PYTHONPATH=$PWD/build/devcarry/py \\
      python3 bench/quality/eval.py --ckpt bench/quality/out --bin build/devcarry/bin --out $OUT
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "clients" / "python"))
import train  # noqa: E402

CODECS = ["bf16", "fp16", "fp8", "fp8_e5m2", "int8", "turbo4", "turbo3", "turbo2"]
DEPTHS = [0.05, 0.25, 0.5, 0.75, 0.95]


def parse_mode(text: str, dense_layers: list[int]) -> dict:
    """One --selects entry: SELECT[+shared][+r<blocks>][+l<layers>] — the selector (mean or
    quest), SHARED, RECENT blocks, and the first <layers> model layers kept dense (Quest keeps
    two; --dense-layers applies where +l is not given)."""
    parts = text.split("+")
    mode = {"name": text, "select": parts[0], "shared": False, "recent": 0,
            "dense_layers": tuple(dense_layers)}
    if mode["select"] not in ("mean", "quest"):
        raise SystemExit("--selects: %r: the selector is mean or quest" % text)
    for p in parts[1:]:
        if p == "shared":
            mode["shared"] = True
        elif p[:1] == "r" and p[1:].isdigit():
            mode["recent"] = int(p[1:])
        elif p[:1] == "l" and p[1:].isdigit():
            mode["dense_layers"] = tuple(range(int(p[1:])))
        else:
            raise SystemExit("--selects: %r: unknown part %r (shared, r<N>, l<N>)" % (text, p))
    return mode


def sparse_auto(hf, mode: dict, block: int, budget: int, **kw):
    return hf.SparseAuto(block_size=block, budget=1 / budget, select=mode["select"],
                         shared=mode["shared"], recent=mode["recent"],
                         dense_layers=mode["dense_layers"], **kw)


def start_server(binary: Path, work: Path, backend: str):
    from benchutil import free_port
    import pion
    port = free_port()
    log = open(work / ("server-%s.log" % backend), "w")
    p = subprocess.Popen([str(binary), "--port", str(port), "--metrics-port", "0",
                          "--binary-port", "0", "--dir", str(work / ("data-" + backend)),
                          "--attention-backend", backend, "--workers", "2"],
                         stdout=log, stderr=subprocess.STDOUT)
    for _ in range(400):
        try:
            c = pion.Client(port=port, socket_timeout=120)
            if c.ping():
                return p, c
        except Exception:  # noqa: BLE001 - starting
            time.sleep(0.05)
    raise RuntimeError("pion-server did not start (see %s)" % log.name)


class Lab:
    def __init__(self, model, client, held: np.ndarray, args):
        import torch
        self.torch = torch
        self.model, self.client, self.held, self.args = model, client, held, args
        self.dev = next(model.parameters()).device

    # ---- data --------------------------------------------------------------------------------
    def text_case(self, i: int):
        """(prefix ids, continuation ids) from held-out text: --prefix bytes then --cont."""
        rnd = random.Random(1000 + i)
        n = self.args.prefix + self.args.cont
        s = rnd.randrange(0, len(self.held) - n - 1)
        x = self.torch.tensor(self.held[s:s + n], dtype=self.torch.long)
        return x[:self.args.prefix], x[self.args.prefix:]

    def needle_case(self, i: int, depth: float):
        """(prefix ids, question ids, digits) with four keys planted, the asked one at depth."""
        seq, q0, ans, digits = train.needle(self.held, self.args.prefix, i, depth)
        x = self.torch.tensor(seq, dtype=self.torch.long)
        return x[:q0], x[q0:ans], digits

    # ---- the model's own and Pion's caches ---------------------------------------------------
    def own_cache(self, prefix):
        with self.torch.no_grad():
            return self.model(input_ids=prefix[None].to(self.dev), use_cache=True).past_key_values

    def step_logits(self, ids, cache) -> "torch.Tensor":
        """Feeds ids one position at a time (each a decode step) and returns the logits after
        each: [len, vocab] fp32."""
        out = []
        with self.torch.no_grad():
            for t in ids.tolist():
                r = self.model(input_ids=self.torch.tensor([[t]], device=self.dev),
                               past_key_values=cache, use_cache=True)
                out.append(r.logits[0, -1].float())
        return self.torch.stack(out)

    def greedy(self, cache, first_logits, n=7) -> str:
        toks = [int(first_logits.argmax())]
        with self.torch.no_grad():
            for _ in range(n - 1):
                r = self.model(input_ids=self.torch.tensor([[toks[-1]]], device=self.dev),
                               past_key_values=cache, use_cache=True)
                toks.append(int(r.logits[0, -1].argmax()))
        return bytes(toks).decode("latin-1")

    def nll(self, logits, targets) -> float:
        """Mean NLL (nats per byte) of targets [n] under logits [n, vocab]."""
        return self.torch.nn.functional.cross_entropy(
            logits, targets.to(logits.device)).item()


def section_exact(lab: Lab, import_hf) -> dict:
    """Stage 1 and Stage 2 dense vs the model's own cache, over --seqs continuations."""
    torch, hf = lab.torch, import_hf
    rows = []
    for i in range(lab.args.seqs):
        prefix, cont = lab.text_case(i)
        full = torch.cat([prefix, cont])
        with torch.no_grad():
            want = lab.model(input_ids=full[None].to(lab.dev)).logits[0, len(prefix):].float()
        pc = hf.PionPromptCache(lab.model, lab.client, codec="bf16")
        pc.get_or_prefill(prefix)
        cache = pc.get_or_prefill(prefix)  # the hit: fetched from Pion
        assert pc.last["hit"], pc.last
        with torch.no_grad():
            s1 = lab.model(input_ids=cont[None].to(lab.dev), past_key_values=cache).logits[0]
        off = hf.PionAttentionOffload(pc)
        try:
            cache = off.prepare(prefix)
            with off.session(cache), torch.no_grad():
                s2 = lab.model(input_ids=cont[None].to(lab.dev), past_key_values=cache).logits[0]
            off.release(cache)
        finally:
            lab.model.set_attn_implementation("sdpa")
        s1, s2 = s1.float(), s2.float()
        rows.append({
            "seq": i,
            "stage1_max_dlogit": (s1 - want).abs().max().item(),
            "stage1_agree": (s1.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "stage2_max_dlogit": (s2 - want).abs().max().item(),
            "stage2_agree": (s2.argmax(-1) == want.argmax(-1)).float().mean().item(),
            "nll_own": lab.nll(want[:-1], cont[1:]), "nll_stage2": lab.nll(s2[:-1], cont[1:])})
        print("exact:", json.dumps(rows[-1]), flush=True)
    return {"rows": rows}


def oracle_omitted(torch, bm, counts) -> float:
    """The least mass any selection of as many blocks could leave out: each head keeps its
    counts[h] blocks of most true mass (bm [H_q, blocks]); the mean over heads. What separates
    a selector's misses from attention too broad for the budget."""
    srt = bm.sort(dim=1, descending=True).values.cumsum(1)
    c = torch.tensor(counts, device=bm.device, dtype=torch.long)
    kept = srt.gather(1, (c - 1).clamp(min=0)[:, None])[:, 0] * (c > 0)
    return (bm.sum(1) - kept).mean().item()


def mass_columns(calls) -> tuple:
    """Per-call (true, estimate, bound, audit, oracle) omitted masses -> five arrays."""
    cols = np.array(calls, dtype=np.float64).reshape(-1, 5)
    return tuple(cols[:, i] for i in range(5))


class MassProbe:
    """True omitted mass of each sparse call: softmax over the prefix (the model's own keys
    for that layer) and the local suffix, less the mass of the blocks the receipt names and
    of the suffix."""

    def __init__(self, lab: Lab, own, block: int, hq: int, hkv: int):
        self.lab, self.block, self.hq, self.hkv = lab, block, hq, hkv
        # own cache's keys per layer: [H_kv, P, D] fp32 on the device
        self.keys = {}
        for li in range(len(own.layers)):
            self.keys[li] = own.layers[li].keys[0].float()
        self.pairs = []  # (true, estimate, bound, the server's AUDIT, the oracle's): a call each

    def __call__(self, layer_idx, q, k_suf, v_suf, res):
        torch = self.lab.torch
        kp = self.keys[layer_idx].to(q.device)
        d = q.shape[-1]
        g = self.hq // self.hkv
        kpe = kp.repeat_interleave(g, dim=0)  # [Hq, P, D]
        kse = k_suf.to(q.device).repeat_interleave(g, dim=0)
        sp = torch.einsum("hd,hpd->hp", q, kpe) / math.sqrt(d)
        ss = torch.einsum("hd,hsd->hs", q, kse) / math.sqrt(d)
        lse = torch.logsumexp(torch.cat([sp, ss], dim=1), dim=1, keepdim=True)
        pp = torch.exp(sp - lse)  # [Hq, P]
        P = pp.shape[1]
        nb = -(-P // self.block)
        pad = nb * self.block - P
        bm = torch.nn.functional.pad(pp, (0, pad)).view(self.hq, nb, self.block).sum(-1)
        rc = res.receipt
        kept = torch.zeros(self.hq, nb, device=q.device)
        for h, blocks in enumerate(rc["blocks"]):
            if blocks:
                kept[h, torch.tensor(blocks, device=q.device, dtype=torch.long)] = 1
        omitted = (bm * (1 - kept)).sum(-1)  # per head
        self.pairs.append((omitted.mean().item(), float(rc["omitted_mass_estimate"]),
                           float(rc["omitted_mass_bound"]),
                           float(rc.get("omitted_mass_exact", float("nan"))),
                           oracle_omitted(torch, bm, [len(b) for b in rc["blocks"]])))


def section_sparse(lab: Lab, hf, budgets, selects, needle_budgets) -> dict:
    torch = lab.torch
    cfg = lab.model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    pc = hf.PionPromptCache(lab.model, lab.client, codec="bf16")
    off = hf.PionAttentionOffload(pc)
    out = {"ppl": [], "needle": [], "mass": []}
    try:
        # Perplexity: every continuation position a decode step.
        cases = [lab.text_case(i) for i in range(lab.args.seqs)]
        dense_nll = []
        for prefix, cont in cases:
            off.sparse = None
            cache = off.prepare(prefix)
            with off.session(cache):
                lg = lab.step_logits(cont[:-1], cache)
            off.release(cache)
            dense_nll.append(lab.nll(lg, cont[1:]))
        for mode in selects:
            for b in budgets:
                nlls, probe_pairs = [], []
                for (prefix, cont) in cases:
                    probe = MassProbe(lab, lab.own_cache(prefix), lab.args.block, hq, hkv)
                    off.sparse = sparse_auto(hf, mode, lab.args.block, b, receipts=[],
                                             observe=probe, audit=True)
                    cache = off.prepare(prefix)
                    with off.session(cache):
                        lg = lab.step_logits(cont[:-1], cache)
                    off.release(cache)
                    nlls.append(lab.nll(lg, cont[1:]))
                    probe_pairs += probe.pairs
                t, e, u, x, o = mass_columns(probe_pairs)
                row = {"select": mode["name"], "shared": mode["shared"],
                       "recent": mode["recent"], "dense_layers": list(mode["dense_layers"]),
                       "budget": "1/%d" % b,
                       "nll_dense": float(np.mean(dense_nll)), "nll": float(np.mean(nlls)),
                       "ppl_delta_pct": 100 * (math.exp(np.mean(nlls) - np.mean(dense_nll)) - 1),
                       "calls": len(t), "true_omitted_mean": float(t.mean()),
                       "true_omitted_p95": float(np.percentile(t, 95)),
                       "oracle_omitted_mean": float(o.mean()),
                       "estimate_mean": float(e.mean()),
                       "estimate_minus_true_min": float((e - t).min()),
                       "estimate_minus_true_max": float((e - t).max()),
                       "within_0.02": float(np.mean(np.abs(e - t) <= 0.02)),
                       "below_true": float(np.mean(e < t - 1e-6)),
                       "bound_mean": float(u.mean()),
                       "bound_minus_true_min": float((u - t).min()),
                       "bound_minus_true_mean": float((u - t).mean()),
                       "bound_below_true": float(np.mean(u < t - 1e-6)),
                       "audit_max_abs_diff": float(np.abs(x - t).max())}
                out["ppl"].append(row)
                out["mass"].append({"select": mode["name"], "shared": False, "budget": b,
                                    "true": t[::max(1, len(t) // 400)].tolist(),
                                    "estimate": e[::max(1, len(e) // 400)].tolist(),
                                    "bound": u[::max(1, len(u) // 400)].tolist()})
                print("sparse ppl:", json.dumps(row), flush=True)
        # Needles: accuracy by depth, dense and sparse.
        for depth in DEPTHS:
            cases = [lab.needle_case(i, depth) for i in range(lab.args.needles)]
            modes = [("dense", None)] + [
                ("%s 1/%d" % (m["name"], b), (m, b)) for m in selects
                for b in needle_budgets]
            for name, mode in modes:
                right = 0
                for prefix, question, digits in cases:
                    off.sparse = None if mode is None else sparse_auto(
                        hf, mode[0], lab.args.block, mode[1])
                    cache = off.prepare(prefix)
                    with off.session(cache):
                        lg = lab.step_logits(question, cache)
                        got = lab.greedy(cache, lg[-1])
                    off.release(cache)
                    right += got == digits
                out["needle"].append({"depth": depth, "mode": name,
                                      "accuracy": right / len(cases)})
            print("needle depth %.2f:" % depth, json.dumps(
                {r["mode"]: r["accuracy"] for r in out["needle"] if r["depth"] == depth}),
                flush=True)
    finally:
        lab.model.set_attn_implementation("sdpa")
    return out


def section_codecs(lab: Lab, hf, codecs) -> dict:
    torch = lab.torch
    rows = []
    texts = [lab.text_case(i) for i in range(lab.args.seqs)]
    needles = [lab.needle_case(i, d) for d in DEPTHS for i in range(max(1, lab.args.needles // 2))]
    for codec in codecs:
        pc = hf.PionPromptCache(lab.model, lab.client, codec=codec)
        # A namespace per codec: the prompt cache names a prefix by model and tokens, and a hit
        # serves whatever codec stored it first.
        ns_of = lambda p: pc.namespace_for(p) + "@" + codec  # noqa: E731
        nlls = []
        for prefix, cont in texts:
            pc.get_or_prefill(prefix, ns_of(prefix))
            cache = pc.get_or_prefill(prefix, ns_of(prefix))
            assert pc.last["hit"], pc.last
            with torch.no_grad():
                lg = lab.model(input_ids=cont[None].to(lab.dev), past_key_values=cache).logits[0]
            nlls.append(lab.nll(lg[:-1].float(), cont[1:]))
        right = 0
        for prefix, question, digits in needles:
            pc.get_or_prefill(prefix, ns_of(prefix))
            cache = pc.get_or_prefill(prefix, ns_of(prefix))
            lg = lab.step_logits(question, cache)
            right += lab.greedy(cache, lg[-1]) == digits
        info = lab.client.execute("V.INFO", pc._ns(ns_of(texts[0][0]), "full") + "_pk")
        info = dict(zip(info[::2], info[1::2])) if isinstance(info, list) else info
        row_bytes = int(info.get(b"row_bytes", info.get("row_bytes")))
        layers = lab.model.config.num_hidden_layers
        rows.append({"codec": codec, "bytes_per_token": 2 * layers * row_bytes,
                     "nll": float(np.mean(nlls)), "needle_accuracy": right / len(needles)})
        print("codec:", json.dumps(rows[-1]), flush=True)
    base = next(r for r in rows if r["codec"] == "bf16")
    for r in rows:
        r["ppl_delta_pct"] = 100 * (math.exp(r["nll"] - base["nll"]) - 1)
    return {"rows": rows}


def label(r: dict) -> str:
    """A row's mode: its --selects entry (older results: select and a shared flag)."""
    name = r["select"]
    return name + (" shared" if r.get("shared") and "+" not in name else "")


def markdown(res: dict) -> list[str]:
    a = res["args"]
    lines = ["# Quality on trained attention: the quality lab's model through Pion", "",
             "- date: %s" % res["date"], "- machine: %s" % res["device"],
             "- commit: %s" % res["commit"],
             "- model: %s (train.py: %s)" % (res["model"], res["trained"]),
             "- command: `%s`" % res["command"],
             "- prefix %d bytes (tokens), continuation %d, %d held-out sequences, %d needles per "
             "depth, block %d, dense layers %s, backend %s" % (
                 a["prefix"], a["cont"], a["seqs"], a["needles"], a["block"],
                 a["dense_layers"] or "none", a["backend"]), ""]
    if "exact" in res:
        lines += ["## Exactness (against the model's own cache)", "",
                  "| seq | Stage 1 max abs dlogit | Stage 1 agreement | Stage 2 max abs dlogit | "
                  "Stage 2 agreement | NLL own | NLL Stage 2 |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in res["exact"]["rows"]:
            lines.append("| %d | %.3g | %.4f | %.3g | %.4f | %.4f | %.4f |" % (
                r["seq"], r["stage1_max_dlogit"], r["stage1_agree"], r["stage2_max_dlogit"],
                r["stage2_agree"], r["nll_own"], r["nll_stage2"]))
        lines.append("")
    if "sparse" in res:
        s = res["sparse"]
        lines += ["## Sparse-auto decode (Stage 2) against dense", "",
                  "| select | budget | held-out ppl Δ | true omitted mass (mean, p95) | oracle "
                  "omitted (mean) | receipt "
                  "estimate (mean) | estimate − true (min, max) | within ±0.02 | estimate below "
                  "true | bound (mean) | bound − true (min, mean) | bound below true | calls |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s["ppl"]:
            lines.append("| %s%s | %s | %+.2f %% | %.4f, %.4f | %.4f | %.4f | %+.4f, %+.4f | "
                         "%.1f %% | %.1f %% | %.4f | %+.4f, %+.4f | %.1f %% | %d |" % (
                             label(r), "", r["budget"],
                             r["ppl_delta_pct"], r["true_omitted_mean"], r["true_omitted_p95"],
                             r.get("oracle_omitted_mean", float("nan")),
                             r["estimate_mean"], r["estimate_minus_true_min"],
                             r["estimate_minus_true_max"], 100 * r["within_0.02"],
                             100 * r["below_true"], r.get("bound_mean", float("nan")),
                             r.get("bound_minus_true_min", float("nan")),
                             r.get("bound_minus_true_mean", float("nan")),
                             100 * r.get("bound_below_true", float("nan")), r["calls"]))
        modes = []
        for r in s["needle"]:
            if r["mode"] not in modes:
                modes.append(r["mode"])
        lines += ["", "Passkey accuracy by depth (4 keys planted, one asked; the question and "
                  "the digits decoded step by step):", "",
                  "| mode | " + " | ".join("%.2f" % d for d in DEPTHS) + " |",
                  "|---|" + "---:|" * len(DEPTHS)]
        for m in modes:
            accs = {r["depth"]: r["accuracy"] for r in s["needle"] if r["mode"] == m}
            lines.append("| %s | " % m + " | ".join("%.2f" % accs.get(d, float("nan"))
                                                     for d in DEPTHS) + " |")
        lines.append("")
    if "codecs" in res:
        lines += ["## K/V codecs (Stage 1, PionPromptCache)", "",
                  "| codec | bytes / token | held-out ppl Δ vs bf16 | passkey accuracy |",
                  "|---|---:|---:|---:|"]
        for r in res["codecs"]["rows"]:
            lines.append("| %s | %d | %+.3f %% | %.2f |" % (
                r["codec"], r["bytes_per_token"], r["ppl_delta_pct"], r["needle_accuracy"]))
        lines.append("")
    return lines


def plot(res: dict, out: Path) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib absent: no PNGs (eval.py --plot quality.json elsewhere)")
        return []
    made = []
    if "sparse" in res:
        s = res["sparse"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in sorted({label(r) for r in s["ppl"]}):
            rr = [r for r in s["ppl"] if label(r) == key]
            xs = [int(r["budget"].split("/")[1]) for r in rr]
            ax.plot(xs, [r["ppl_delta_pct"] for r in rr], "o-",
                    label=key)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("budget 1/x of the prefix's blocks")
        ax.set_ylabel("held-out perplexity delta vs dense (%)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "quality-vs-budget.png", dpi=100)
        made.append("quality-vs-budget.png")
        fig, ax = plt.subplots(figsize=(5, 5))
        for m in s["mass"]:
            ax.scatter(m["true"], m["estimate"], s=3, alpha=0.4,
                       label="%s 1/%d" % (label(m), m["budget"]))
            if m.get("bound"):
                ax.scatter(m["true"], m["bound"], s=3, alpha=0.4, marker="x",
                           label="bound, %s 1/%d" % (label(m), m["budget"]))
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlabel("true omitted mass")
        ax.set_ylabel("receipt: omitted_mass_estimate (o), omitted_mass_bound (x)")
        ax.legend(fontsize=6, markerscale=3)
        fig.tight_layout()
        fig.savefig(out / "receipt-vs-true.png", dpi=100)
        made.append("receipt-vs-true.png")
    if "codecs" in res:
        rr = res["codecs"]["rows"]
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["bytes_per_token"] for r in rr], [r["ppl_delta_pct"] for r in rr], "o")
        for r in rr:
            ax.annotate(r["codec"], (r["bytes_per_token"], r["ppl_delta_pct"]), fontsize=7)
        ax.set_xlabel("bytes per token (K and V, all layers)")
        ax.set_ylabel("held-out perplexity delta vs bf16 (%)")
        fig.tight_layout()
        fig.savefig(out / "quality-vs-bytes.png", dpi=100)
        made.append("quality-vs-bytes.png")
    return made


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default=str(HERE / "out"))
    ap.add_argument("--bin", default=str(REPO / "build" / "devcarry" / "bin"))
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--out", default=str(HERE / "out"))
    ap.add_argument("--sections", default="exact,sparse,codecs")
    ap.add_argument("--prefix", type=int, default=7680)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--seqs", type=int, default=4)
    ap.add_argument("--needles", type=int, default=8)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--budgets", default="4,8,16,32")
    ap.add_argument("--selects", default="mean,quest,mean+shared,quest+shared",
                    help="comma-separated SELECT[+shared][+r<blocks>][+l<layers>]: the "
                         "selector, SHARED, RECENT blocks, the first layers kept dense")
    ap.add_argument("--needle-budgets", default="",
                    help="the budgets the passkeys are decoded at (default: --budgets)")
    ap.add_argument("--dense-layers", default="",
                    help="model layers kept exact for every --selects entry without +l")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--corpus-mb", type=int, default=400,
                    help="train.py's --corpus-mb (the held-out split is the same files then)")
    ap.add_argument("--plot", default=None, help="only draw the PNGs of a quality.json")
    args = ap.parse_args()
    if args.plot:
        p = Path(args.plot)
        print(plot(json.loads(p.read_text()), p.parent))
        return 0
    args.dense_layers = [int(x) for x in args.dense_layers.split(",") if x != ""]
    import torch
    import pion.hf as hf
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = train.load(Path(args.ckpt))
    trained = json.loads((Path(args.ckpt) / "config.json").read_text()).get("pion_quality", {})
    model.set_attn_implementation("sdpa")
    # The held-out text: the same split train.py made on this machine (same packages).
    _, held, info = train.corpus(train.package_roots(), args.corpus_mb << 20)
    want = trained.get("corpus", {}).get("paths_sha1")
    print("held-out: %d bytes from %d files; corpus %s train.py's" % (
        len(held), info["heldout_files"], "matches" if want in (None, info["paths_sha1"])
        else "DIFFERS from"), flush=True)
    with tempfile.TemporaryDirectory(prefix="pion-quality-") as d:
        proc, client = start_server(Path(args.bin) / "pion-server", Path(d), args.backend)
        try:
            lab = Lab(model, client, held, args)
            res = {"args": vars(args), "date": dt.datetime.now(dt.timezone.utc).strftime(
                       "%Y-%m-%d %H:%M UTC"),
                   "device": torch.cuda.get_device_name(0) if torch.cuda.is_available()
                   else "cpu", "commit": subprocess.run(
                       ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=REPO).stdout.strip() or "(not a checkout)",
                   "model": "%.1f M parameters, %d layers, GQA %d/%d, head_dim %d" % (
                       sum(p.numel() for p in model.parameters()) / 1e6,
                       model.config.num_hidden_layers, model.config.num_attention_heads,
                       model.config.num_key_value_heads, model.config.head_dim),
                   "trained": {k: trained.get(k) for k in ("steps_done", "train_seconds",
                                                           "tokens", "final", "device")},
                   "command": "python3 bench/quality/eval.py " + " ".join(sys.argv[1:])}
            secs = args.sections.split(",")
            budgets = [int(x) for x in args.budgets.split(",")]
            selects = [parse_mode(m, args.dense_layers) for m in args.selects.split(",")]
            needle_budgets = ([int(x) for x in args.needle_budgets.split(",")]
                              if args.needle_budgets else budgets)
            def keep():  # after each section: a run cut short still leaves what it measured
                res["seconds"] = round(time.time() - t0, 1)
                (out / "quality.json").write_text(json.dumps(res, indent=1))
                (out / "quality.md").write_text("\n".join(markdown(res)) + "\n")

            if "exact" in secs:
                res["exact"] = section_exact(lab, hf)
                keep()
            if "sparse" in secs:
                res["sparse"] = section_sparse(lab, hf, budgets, selects, needle_budgets)
                keep()
            if "codecs" in secs:
                res["codecs"] = section_codecs(lab, hf, args.codecs.split(","))
                keep()
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    res["seconds"] = round(time.time() - t0, 1)
    (out / "quality.json").write_text(json.dumps(res, indent=1))
    (out / "quality.md").write_text("\n".join(markdown(res)) + "\n")
    print("\n".join(markdown(res)))
    print("plots:", plot(res, out), "; %.0f s" % res["seconds"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
