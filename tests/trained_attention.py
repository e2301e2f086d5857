"""A small attention model trained here on the CPU (Debian's python3-torch), so that tests check
Pion's approximate attention on trained, peaked attention rather than on Gaussian K/V.

The task is multi-query associative recall over a long context: filler tokens with key/value
pairs (`k v`, adjacent) at random depths; a query is a key token, and the model must answer the
value that followed it. The model: token embeddings plus a learned embedding of the previous
token (a one-token shift, as in H3/Based's short convolution, so that a value token carries its
key), two pre-norm attention-only layers with GQA (4 query heads, 2 K/V heads, head_dim 32) and
no positional encoding — causal attention alone, so the retrieval learned on 64-token sequences
holds on contexts of thousands of tokens. It trains in 450-650 steps (35-70 s on one core of
the loaded 2-core dev box); `trained()` trains once per process and caches the model.

For Pion the model is split at the query: `context_kv` gives every layer's K/V of a context
(what a server stores as ATTEND.PREFIX slots), and `answer` runs one query token through the
layers with each layer's attention over [context, the query itself] computed by a callback —
dense in numpy here (`dense_attend`), or by a server's ATTEND.PREFIX.QUERY_*_FUSED forms.
"""
from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np

N_KEYS, N_VALUES, N_FILLER = 64, 64, 64
KEY0 = 1
VALUE0 = KEY0 + N_KEYS
FILLER0 = VALUE0 + N_VALUES
VOCAB = FILLER0 + N_FILLER
D_MODEL, H_Q, H_KV, HEAD_DIM, LAYERS = 64, 4, 2, 32, 2
TRAIN_LEN, TRAIN_PAIRS, TRAIN_QUERIES, BATCH = 64, 12, 4, 32
SEED = 55


def _torch():
    import torch  # lazily: importing this module must not need torch
    return torch


@dataclass
class Context:
    """One recall context: `ids` [N] int64, and its pairs (key, value token, position of the
    value token) — every key occurs once."""
    ids: np.ndarray
    keys: np.ndarray
    values: np.ndarray
    value_pos: np.ndarray


def make_context(rng: np.random.Generator, n: int, pairs: int) -> Context:
    """Filler tokens with `pairs` key/value pairs at random even positions (random depths)."""
    ids = rng.integers(FILLER0, FILLER0 + N_FILLER, n)
    keys = rng.permutation(N_KEYS)[:pairs] + KEY0
    values = rng.integers(VALUE0, VALUE0 + N_VALUES, pairs)
    slots = np.sort(rng.permutation(n // 2)[:pairs]) * 2
    ids[slots], ids[slots + 1] = keys, values
    order = np.argsort(slots)
    return Context(ids.astype(np.int64), keys[order], values[order], slots[order] + 1)


def _batch(torch, g, pairs):
    """Training batch: TRAIN_LEN context tokens then TRAIN_QUERIES `k v` recalls; the loss is on
    the recalled values only."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=g)))
    seqs = []
    for _ in range(BATCH):
        c = make_context(rng, TRAIN_LEN, pairs)
        ask = rng.integers(0, pairs, TRAIN_QUERIES)
        seqs.append(np.concatenate([c.ids, np.stack([c.keys[ask], c.values[ask]], 1).ravel()]))
    ids = torch.from_numpy(np.stack(seqs))
    target = torch.full_like(ids, -100)
    target[:, TRAIN_LEN:-1:2] = ids[:, TRAIN_LEN + 1::2]
    return ids, target


def _build(torch):
    nn = torch.nn

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(D_MODEL)
            self.q = nn.Linear(D_MODEL, H_Q * HEAD_DIM, bias=False)
            self.k = nn.Linear(D_MODEL, H_KV * HEAD_DIM, bias=False)
            self.v = nn.Linear(D_MODEL, H_KV * HEAD_DIM, bias=False)
            self.o = nn.Linear(H_Q * HEAD_DIM, D_MODEL, bias=False)

        def qkv(self, x):
            """x [B, L, D_MODEL] -> q [B, H_Q, L, hd], k, v [B, H_KV, L, hd]."""
            b, n, _ = x.shape
            h = self.norm(x)
            return (self.q(h).view(b, n, H_Q, HEAD_DIM).transpose(1, 2),
                    self.k(h).view(b, n, H_KV, HEAD_DIM).transpose(1, 2),
                    self.v(h).view(b, n, H_KV, HEAD_DIM).transpose(1, 2))

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(x)
            k = k.repeat_interleave(H_Q // H_KV, 1)
            v = v.repeat_interleave(H_Q // H_KV, 1)
            s = q @ k.transpose(-1, -2) / math.sqrt(HEAD_DIM)
            s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            o = (s.softmax(-1) @ v).transpose(1, 2).reshape(b, n, H_Q * HEAD_DIM)
            return x + self.o(o)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(VOCAB, D_MODEL)
            self.prev = nn.Embedding(VOCAB, D_MODEL)  # the previous token's embedding
            self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
            self.norm = nn.LayerNorm(D_MODEL)
            self.out = nn.Linear(D_MODEL, VOCAB, bias=False)

        def embed(self, ids):
            x = self.emb(ids)
            return x + torch.nn.functional.pad(self.prev(ids[:, :-1]), (0, 0, 1, 0))

        def forward(self, ids):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x)
            return self.out(self.norm(x))

    return Model()


class TrainedModel:
    """The trained torch model, with the split at the query that Pion's forms need."""

    def __init__(self, model, steps: int, seconds: float, train_accuracy: float):
        self.model = model.eval()
        self.steps, self.seconds, self.train_accuracy = steps, seconds, train_accuracy

    def context_kv(self, ids: np.ndarray):
        """Every layer's K and V of a context: a list of (k, v), each float32 [H_KV, N, hd]."""
        torch = _torch()
        out = []
        with torch.no_grad():
            x = self.model.embed(torch.from_numpy(ids)[None])
            for layer in self.model.layers:
                _, k, v = layer.qkv(x)
                out.append((k[0].numpy().copy(), v[0].numpy().copy()))
                x = layer(x)
        return out

    def answer(self, last_context_token: int, key: int, attend):
        """Runs the query token `key` at the position right after the context through the model.
        attend(layer, q [H_Q, hd], k_self, v_self [H_KV, 1, hd]) -> out [H_Q, hd] computes the
        layer's attention over the context plus the query's own K/V. Returns the logits [VOCAB]
        (float64 numpy)."""
        torch = _torch()
        m = self.model
        with torch.no_grad():
            x = m.emb(torch.tensor([[key]])) + m.prev(torch.tensor([[last_context_token]]))
            for i, layer in enumerate(m.layers):
                q, k, v = layer.qkv(x)
                o = attend(i, q[0, :, 0].numpy(), k[0].numpy(), v[0].numpy())
                x = x + layer.o(torch.from_numpy(np.array(o, np.float32))
                                .reshape(1, 1, H_Q * HEAD_DIM))
            return m.out(m.norm(x))[0, 0].double().numpy()

    def full_logits(self, ids: np.ndarray) -> np.ndarray:
        """The model's own logits at the last position of ids (the reference forward)."""
        torch = _torch()
        with torch.no_grad():
            return self.model(torch.from_numpy(ids)[None])[0, -1].double().numpy()


def recall_queries(model: TrainedModel, ctx: Context, kv) -> np.ndarray:
    """The query vectors of every key of ctx asked after it, per layer (dense attention):
    float32 [len(ctx.keys), LAYERS, H_Q, hd]."""
    out = np.zeros((len(ctx.keys), LAYERS, H_Q, HEAD_DIM), np.float32)
    dense = dense_attend(kv)
    for i, key in enumerate(ctx.keys):
        def attend(layer, q, k_self, v_self):
            out[i, layer] = q
            return dense(layer, q, k_self, v_self)
        model.answer(int(ctx.ids[-1]), int(key), attend)
    return out


def dense_scores(kv, layer, q, k_self):
    """Scaled scores [H_Q, N + 1] of q over the context's keys plus the query's own key."""
    k = np.concatenate([kv[layer][0], k_self], axis=1).astype(np.float64)  # [H_KV, N+1, hd]
    group = H_Q // H_KV
    return np.einsum("hd,hnd->hn", q.astype(np.float64),
                     np.repeat(k, group, axis=0)) / math.sqrt(HEAD_DIM)


def softmax(s):
    p = np.exp(s - s.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def dense_attend(kv, keep=None):
    """An `attend` callback over context K/V `kv` computed in numpy (float64). keep(layer, q,
    probs) -> bool mask [H_Q, N] of the context rows each head attends (None: all; the query's
    own row is always attended) — for reference selectors."""
    def attend(layer, q, k_self, v_self):
        s = dense_scores(kv, layer, q, k_self)
        if keep is not None:
            mask = keep(layer, q, softmax(s))
            s[:, :-1] = np.where(mask, s[:, :-1], -np.inf)
        v = np.concatenate([kv[layer][1], v_self], axis=1).astype(np.float64)
        return np.einsum("hn,hnd->hd", softmax(s), np.repeat(v, H_Q // H_KV, axis=0))
    return attend


def _train():
    torch = _torch()
    threads = torch.get_num_threads()
    # One thread: on a small shared box OpenMP's spinning threads cost more than they bring,
    # and one thread gives the same model run after run.
    torch.set_num_threads(1)
    try:
        torch.manual_seed(SEED)
        g = torch.Generator().manual_seed(SEED)
        model = _build(torch)
        # Weight decay 0.1, as language models are trained (without it the retrieval layer's
        # filler keys spread wider and block selection loses more needles).
        opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.1)
        t0, recent, step = time.monotonic(), [], 0
        # Until the recall is learned (a plateau, then a jump, typically near step 400), and
        # 100 steps more; at most 2000 steps.
        while step < 2000:
            pairs = int(torch.randint(4, TRAIN_PAIRS + 1, (1,), generator=g))
            ids, target = _batch(torch, g, pairs)
            logits = model(ids)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB),
                                                     target.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            m = target != -100
            recent = (recent + [(logits.argmax(-1)[m] == target[m]).float().mean().item()])[-100:]
            if len(recent) == 100 and min(recent[-20:]) >= 0.99 and np.mean(recent) >= 0.95:
                break
        return TrainedModel(model, step, time.monotonic() - t0, float(np.mean(recent[-20:])))
    finally:
        torch.set_num_threads(threads)


@functools.lru_cache(maxsize=1)
def trained() -> TrainedModel:
    """The trained model (trained on the first call of the process, then cached)."""
    return _train()
