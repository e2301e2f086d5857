#!/usr/bin/env python3
"""Trains the quality lab's model on the GPU machine (issue 55 §1): a small GQA Llama
(transformers' LlamaForCausalLM, so pion.hf works on it unchanged) on the text found on that
machine, with a share of sequences that can only be finished by retrieving a passkey planted
thousands of bytes earlier, so that retrieval heads form and its attention is peaked and
structured the way a trained model's is.

- Text: every .py, .md, .rst and .txt file of 1 KiB-1 MiB under the machine's Python
  packages, sorted by path; a file is held out when the SHA-1 of its path ends in 0 mod 20
  (so the split is by file, the same on every run over the same packages). Tokens are bytes
  (vocabulary 256): no tokenizer to train or carry.
- Retrieval: --retrieval of the sequences carry 1-8 lines "passkey of <name> is <7 digits>."
  at random line boundaries and end with 1-3 of those names asked again ("passkey of <name> is
  " and its digits): multi-key recall at random depths. The answers' bytes weigh --answer-weight
  in the loss.
- Curriculum: for the first --short-fraction of the training the sequences are --short-context
  bytes (1024), --short-batch a step, and --short-retrieval of them recall drills with 2-8 keys
  all asked: the retrieval circuit forms where keys are near and every answer teaches (at full
  context alone, 3 minutes on an H100 left the answers at chance, 2.3 nats a digit). Then full
  context with --retrieval of the sequences carrying keys. The learning rate follows one
  warm-up and cosine over both phases (by the clock, or by steps with --steps).
- Model (defaults): 8 layers, hidden 512, 8 query heads and 2 K/V heads of 64 (GQA 4:1), MLP
  1024, RoPE theta 1e4 (transformers' default), tied embeddings: 17.9 M parameters (36 MB in
  bf16: with a server-only gpu-bundle it fits the 64 MiB a GPU call carries); context
  --context (8192).
- Deterministic from --seed for the data order and initialisation (GPU kernels may still round
  differently from run to run); the checkpoint is kept as bf16 safetensors shards of at most
  15 MiB with config.json, the loss curve as loss.json (and loss.png where matplotlib exists).

Run on the GPU machine (about 8 minutes on one H100):
    python3 bench/quality/train.py --out bench/quality/out
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np

EXTS = (".py", ".md", ".rst", ".txt")
MIN_FILE, MAX_FILE = 1 << 10, 1 << 20
NAME_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def package_roots() -> list[Path]:
    """The directories that hold the machine's Python packages (site- and dist-packages and
    the standard library), deduplicated."""
    roots = []
    for p in sys.path:
        q = Path(p)
        if q.is_dir() and (q.name in ("site-packages", "dist-packages") or
                           (q.name.startswith("python3") and q.parent.name == "lib")):
            roots.append(q.resolve())
    return sorted(set(roots))


def corpus(roots: list[Path], max_bytes: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train bytes, held-out bytes, a description) from the files under roots, files joined
    by a blank line; each side capped at its share of max_bytes (held out: 1/20)."""
    files = []
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for f in sorted(filenames):
                if f.endswith(EXTS):
                    p = Path(dirpath) / f
                    try:
                        size = p.stat().st_size
                    except OSError:
                        continue
                    if MIN_FILE <= size <= MAX_FILE:
                        files.append((str(p.relative_to(root)), p))
    files.sort()
    train, held = [], []
    n_train = n_held = 0
    digest = hashlib.sha1()
    for rel, p in files:
        h = int(hashlib.sha1(rel.encode()).hexdigest(), 16)
        is_held = h % 20 == 0
        if (n_held if is_held else n_train) >= (max_bytes // 20 if is_held else max_bytes):
            continue
        try:
            data = p.read_bytes()
        except OSError:
            continue
        digest.update(rel.encode())
        (held if is_held else train).append(data + b"\n\n")
        if is_held:
            n_held += len(data) + 2
        else:
            n_train += len(data) + 2
    info = {"roots": [str(r) for r in roots], "files_seen": len(files),
            "train_files": len(train), "heldout_files": len(held), "train_bytes": n_train,
            "heldout_bytes": n_held, "paths_sha1": digest.hexdigest()}
    return (np.frombuffer(b"".join(train), np.uint8).copy(),
            np.frombuffer(b"".join(held), np.uint8).copy(), info)


def passkey_line(name: str, digits: str) -> bytes:
    return ("passkey of %s is %s.\n" % (name, digits)).encode()


def passkey_query(name: str) -> bytes:
    return ("passkey of %s is " % name).encode()


def random_key(rnd: random.Random) -> tuple[str, str]:
    name = "".join(rnd.choice(NAME_LETTERS) for _ in range(6))
    return name, "".join(rnd.choice("0123456789") for _ in range(7))


def retrieval_sequence(text: np.ndarray, length: int, rnd: random.Random,
                       keys: int | None = None, depths: list[float] | None = None,
                       asks: int | None = None, ask: list[int] | None = None
                       ) -> tuple[np.ndarray, np.ndarray, list]:
    """A sequence of `length` bytes: text with `keys` passkey lines at line boundaries (at the
    given depths, fractions of the text part, else random), ending with `asks` of them asked
    again (`ask`: which, else random), each followed by its digits and ".\\n". Returns (bytes, weight mask: 1 on the answers'
    digits, else 0, [(name, digits, depth, answer offset)])."""
    keys = keys or rnd.randint(1, 8)
    asks = min(asks or rnd.randint(1, 3), keys)
    pairs = [random_key(rnd) for _ in range(keys)]
    asked = ask if ask is not None else rnd.sample(range(keys), asks)
    tail = b"".join(passkey_query(pairs[i][0]) + pairs[i][1].encode() + b".\n" for i in asked)
    lines = [passkey_line(*pq) for pq in pairs]
    body_len = length - len(tail) - sum(len(x) for x in lines) - 1
    start = rnd.randrange(0, len(text) - body_len - 1)
    body = text[start:start + body_len].tobytes()
    depths = depths or [rnd.random() for _ in range(keys)]
    cuts = []
    for d in depths:  # at the next line boundary after the depth
        at = int(d * body_len)
        nl = body.find(b"\n", at)
        cuts.append(body_len if nl < 0 else nl + 1)
    order = sorted(range(keys), key=lambda i: cuts[i])
    out, prev, placed = [], 0, {}
    for i in order:
        out.append(body[prev:cuts[i]])
        placed[i] = (sum(len(x) for x in out), cuts[i] / max(1, body_len))
        out.append(lines[i])
        prev = cuts[i]
    out.append(body[prev:])
    out.append(b"\n")
    seq = b"".join(out)
    weights = np.zeros(length, np.float32)
    meta = []
    pos = len(seq)
    for i in asked:
        q = passkey_query(pairs[i][0])
        ans = pos + len(q)
        weights[ans:ans + 7] = 1.0
        meta.append((pairs[i][0], pairs[i][1], placed[i][1], ans))
        pos += len(q) + 9
    seq += tail
    assert len(seq) == length, (len(seq), length)
    return np.frombuffer(seq, np.uint8).copy(), weights, meta


def needle(text: np.ndarray, prefix_len: int, i: int, depth: float
           ) -> tuple[np.ndarray, int, int, str]:
    """The evaluations' passkey case i at `depth`: four keys planted in prefix_len bytes of
    text, the one at `depth` asked at the end. (bytes, where its question starts, where its
    answer starts, the answer's digits)."""
    rnd = random.Random(2000 + i * 7 + int(depth * 100))
    q_len = len(passkey_query("abcdef"))
    seq, _, meta = retrieval_sequence(text, prefix_len + q_len + 9, rnd, keys=4,
                                      depths=[depth] + [rnd.random() for _ in range(3)], ask=[0])
    _, digits, _, ans = meta[0]
    return seq, ans - q_len, ans, digits


def batch(text: np.ndarray, n: int, length: int, share: float, rnd: random.Random,
          ask_all: bool = False):
    """n sequences of `length` bytes, a `share` of them retrieval sequences (ask_all: every
    planted key is asked, in random order: the dense recall drill of the short phase)."""
    xs, ws = [], []
    for _ in range(n):
        if rnd.random() < share:
            keys = rnd.randint(2, 8) if ask_all else None
            ask = rnd.sample(range(keys), keys) if ask_all else None
            x, w, _ = retrieval_sequence(text, length, rnd, keys=keys, ask=ask)
        else:
            s = rnd.randrange(0, len(text) - length - 1)
            x, w = text[s:s + length].copy(), np.zeros(length, np.float32)
        xs.append(x)
        ws.append(w)
    return np.stack(xs), np.stack(ws)


def model_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.mlp,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                       max_position_embeddings=args.context, tie_word_embeddings=True,
                       bos_token_id=None, eos_token_id=None, pad_token_id=None,
                       attn_implementation="sdpa")


def greedy(model, ids, n: int) -> list[int]:
    """n tokens by greedy decoding after ids [1, T] (the model's own cache)."""
    import torch
    out = []
    with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
        r = model(ids, use_cache=True)
        for _ in range(n):
            t = int(r.logits[0, -1].argmax())
            out.append(t)
            r = model(torch.tensor([[t]], device=ids.device), past_key_values=r.past_key_values,
                      use_cache=True)
    return out


def passkey_accuracy(model, text, length, depths, n, seed, device) -> dict:
    """Greedy 7-digit answers to one asked key (of 4 planted; the asked one at each depth):
    the fraction right."""
    import torch
    rnd = random.Random(seed)
    acc = {}
    for d in depths:
        right = 0
        for _ in range(n):
            seq, _, meta = retrieval_sequence(text, length, rnd, keys=4,
                                              depths=[d] + [rnd.random() for _ in range(3)],
                                              ask=[0])
            _, digits, _, ans = meta[0]
            ids = torch.tensor(seq[:ans], dtype=torch.long, device=device)[None]
            right += bytes(greedy(model, ids, 7)).decode("latin-1") == digits
        acc["%.2f" % d] = right / n
    return acc


def heldout_loss(model, held, length, n, seed, device) -> float:
    import torch
    rnd = random.Random(seed)
    losses = []
    for _ in range(n):
        s = rnd.randrange(0, len(held) - length - 1)
        x = torch.tensor(held[s:s + length], dtype=torch.long, device=device)[None]
        with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
            logits = model(x).logits.float()
        losses.append(torch.nn.functional.cross_entropy(logits[0, :-1], x[0, 1:]).item())
    return float(np.mean(losses))


def save(model, cfg, out: Path, extra: dict) -> list[str]:
    """bf16 safetensors shards of at most 15 MiB, and config.json."""
    from safetensors.torch import save_file
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu").to(__import__("torch").bfloat16).contiguous()
             for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
    shards, cur, size = [], {}, 0
    for k in sorted(state):
        b = state[k].numel() * 2
        if cur and size + b > 15 << 20:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = state[k]
        size += b
    shards.append(cur)
    names = []
    for i, sh in enumerate(shards):
        name = "model-%02d.safetensors" % i
        save_file(sh, str(out / name))
        names.append(name)
    cfg_d = cfg.to_dict()
    cfg_d["pion_quality"] = extra
    (out / "config.json").write_text(json.dumps(cfg_d, indent=1, default=str))
    return names


def load(out: Path, device="cuda"):
    """The model train.py saved in `out` (for eval.py), in bf16 on `device`, eval mode."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM
    d = json.loads((out / "config.json").read_text())
    d.pop("pion_quality", None)
    cfg = LlamaConfig(**d)
    model = LlamaForCausalLM(cfg)
    state = {}
    for f in sorted(out.glob("model-*.safetensors")):
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model.to(device=device, dtype=torch.bfloat16).eval()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/quality/out")
    ap.add_argument("--seed", type=int, default=55)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--mlp", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=0,
                    help="optimizer steps; 0: as many as fit in --minutes, measured over the "
                         "first 30 (the count is recorded in config.json)")
    ap.add_argument("--minutes", type=float, default=7.0,
                    help="the training time for --steps 0; with --steps N, a cap past which "
                         "training stops early (and says so)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--retrieval", type=float, default=0.3,
                    help="the share of retrieval sequences at full context")
    ap.add_argument("--short-context", type=int, default=1024,
                    help="the curriculum's first phase: sequences of this many bytes ...")
    ap.add_argument("--short-batch", type=int, default=64, help="... this many a step ...")
    ap.add_argument("--short-retrieval", type=float, default=0.6,
                    help="... this share of them recall drills, every planted key asked ...")
    ap.add_argument("--short-fraction", type=float, default=0.4,
                    help="... for this fraction of the training (0: no short phase)")
    ap.add_argument("--answer-weight", type=float, default=4.0)
    ap.add_argument("--corpus-mb", type=int, default=400)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args()

    import torch
    from transformers import LlamaForCausalLM

    t_start = time.time()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    train, held, info = corpus(package_roots(), args.corpus_mb << 20)
    print("corpus:", json.dumps(info), flush=True)
    assert len(train) > 50 * args.context and len(held) > 4 * args.context, "too little text"
    device = "cuda"
    cfg = model_config(args)
    model = LlamaForCausalLM(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print("parameters: %.1f M" % (n_params / 1e6), flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    warmup = 50
    budget_s = args.minutes * 60

    def progress(step):
        """How far training is, 0..1: by steps with --steps, else by the clock."""
        if args.steps:
            return step / args.steps
        return (time.time() - t_train) / budget_s

    def lr_at(step, p):
        if step < warmup:
            return args.lr * (step + 1) / warmup
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, p))))

    fwd = torch.compile(model) if args.compile else model
    rnd = random.Random(args.seed)
    curve = []
    evals = []
    t_train = time.time()
    stopped_early = False
    tokens = 0
    step = 0
    phase = None
    while True:
        p = progress(step)
        if p >= 1.0:
            break
        if args.steps and (time.time() - t_train) / 60 > args.minutes:
            stopped_early = True
            break
        # The curriculum: short sequences dense with recall drills first (the retrieval
        # circuit forms where keys are near and every answer teaches), then full context.
        short = p < args.short_fraction
        length = args.short_context if short else args.context
        n = args.short_batch if short else args.batch
        share = args.short_retrieval if short else args.retrieval
        if phase != short:
            phase = short
            print("phase: %s context %d, batch %d, retrieval %.2f%s (step %d, %.0f s)" % (
                "short" if short else "full", length, n, share,
                ", every key asked" if short else "", step, time.time() - t_train), flush=True)
        lr = lr_at(step, p)
        for g in opt.param_groups:
            g["lr"] = lr
        xb, wb = batch(train, n, length, share, rnd, ask_all=short)
        x = torch.from_numpy(xb).to(device, non_blocking=True).long()
        w = torch.from_numpy(wb).to(device, non_blocking=True)
        with torch.autocast("cuda", torch.bfloat16):
            logits = fwd(x).logits
        ce = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, 256),
                                               x[:, 1:].reshape(-1), reduction="none")
        wt = 1.0 + (args.answer_weight - 1.0) * w[:, 1:].reshape(-1)
        loss = (ce * wt).sum() / wt.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens += xb.size
        if step % 10 == 0:
            ans = w[:, 1:].reshape(-1) > 0
            ans_loss = ce[ans].mean().item() if ans.any() else float("nan")
            curve.append({"step": step, "seconds": round(time.time() - t_train, 2),
                          "context": length, "loss": round(ce.mean().item(), 4),
                          "answer_loss": round(ans_loss, 4), "lr": lr})
            if step % 100 == 0:
                print("step %d  %.0f s  ctx %d  loss %.3f  answer %.3f  %.0f ktok/s" % (
                    step, time.time() - t_train, length, curve[-1]["loss"], ans_loss,
                    tokens / (time.time() - t_train) / 1e3), flush=True)
        if args.eval_every and step > 0 and step % args.eval_every == 0:
            model.eval()
            e = {"step": step, "seconds": round(time.time() - t_train, 1),
                 "heldout_loss": heldout_loss(model, held, args.context, 4, args.seed + 1,
                                              device),
                 "passkey": passkey_accuracy(model, held, args.context, [0.1, 0.5, 0.9], 4,
                                             args.seed + 2, device)}
            evals.append(e)
            print("eval:", json.dumps(e), flush=True)
            model.train()
        step += 1
    train_s = time.time() - t_train
    model.eval()
    final = {"step": step, "heldout_loss": heldout_loss(model, held, args.context, 16,
                                                        args.seed + 1, device),
             "heldout_bits_per_byte": None,
             "passkey": passkey_accuracy(model, held, args.context,
                                         [0.05, 0.25, 0.5, 0.75, 0.95], 10, args.seed + 2,
                                         device),
             "passkey_short": passkey_accuracy(model, held, args.short_context or 1024,
                                               [0.1, 0.5, 0.9], 10, args.seed + 3, device)}
    final["heldout_bits_per_byte"] = final["heldout_loss"] / math.log(2)
    print("final:", json.dumps(final), flush=True)
    extra = {"args": vars(args), "corpus": info, "parameters": n_params, "steps_done": step,
             "stopped_early": stopped_early, "train_seconds": round(train_s, 1),
             "tokens": tokens, "final": final, "evals": evals,
             "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
             "transformers": __import__("transformers").__version__}
    names = save(model, cfg, out, extra)
    (out / "loss.json").write_text(json.dumps({"curve": curve, "evals": evals,
                                               "final": final}, indent=0))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([c["step"] for c in curve], [c["loss"] for c in curve], label="train loss")
        ax.plot([c["step"] for c in curve], [c["answer_loss"] for c in curve],
                label="passkey answer loss", alpha=0.6)
        ax.set_xlabel("step")
        ax.set_ylabel("nats per byte")
        ax.set_yscale("log")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "loss.png", dpi=100)
    except ImportError:
        print("matplotlib absent: loss.png not drawn (loss.json has the curve)")
    print("saved %s in %s; %.0f s in all" % (", ".join(names), out, time.time() - t_start),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
