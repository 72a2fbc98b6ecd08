"""Packed rows through Gated DeltaNet layers (Qwen3.5 / Qwen3.6 hybrids) in one forward, exact.

A packed row holds several documents. The full-attention layers keep them apart per document
(model.py). A Gated DeltaNet layer mixes tokens in two places, and both must restart at every
document:
  - the short causal depthwise conv1d (kernel 4) in front of the recurrence. transformers' own
    forward runs it over the whole row, so the last kernel-1 tokens of one document leak into the
    next, and the recurrent state carries the error on (NVIDIA NeMo Automodel PR 2147 measured a
    layer-output difference of 0.40). Here tap d, which looks d tokens back, is zeroed wherever the
    token's position inside its document is below d: the row's position ids restart at 0 for each
    document, so they say exactly where each document begins.
  - the gated delta rule: flash-linear-attention's chunked kernel with the document boundaries
    (cu_seqlens), on CUDA. Elsewhere the same chunked form in plain torch, restarted per document
    (reference_delta_rule; the tests check it against the rule token by token and against
    transformers' own chunked torch code).
Everything else in the layer (projections, gated norm, output projection) is per token and runs
once over the whole row, which is where the speed comes from: a chat row of 8192 tokens holds
about 160 documents, and one forward per document ran 18x slower than one forward per row.

Decoding (services/target/verify/decode.py) uses the same modules in a decode mode: when the slot holds
a DecodeState, each layer continues from its conv tail and fp32 recurrent state instead of
restarting, and a verified block can be cut back to its first n tokens (DecodeState says how); those
states, for one prompt or for rows of a KV cache, are hybrid_states.py's.
transformers' own cache layers for linear attention are not used: their past-state recording
differs between 5.x releases.

The math follows transformers' Qwen3_5GatedDeltaNet (itself from the Qwen3-Next release) and
flash-linear-attention's `chunk_gated_delta_rule` (github.com/fla-org/flash-linear-attention).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from services.target.model.hybrid_states import DecodeState, LayerState, RowStates, conv_after, only_first
from services.target.model.row import RowLayout, RowSlot

# the layer attributes this forward reads (transformers' Qwen3.5 Gated DeltaNet, 5.x)
_GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "dt_bias", "A_log", "norm", "out_proj")


def fla_recurrent_rule():
    """flash-linear-attention's fused recurrent gated delta rule (one kernel, for the few tokens of a
    decoding step), or None when it cannot be imported."""
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except Exception:
        return None
    return fused_recurrent_gated_delta_rule


# a decoding step of at most this many tokens runs the fused recurrent kernel, a longer one (a prefill) the chunked one
RECURRENT_TOKENS = 64


def fla_delta_rule():
    """flash-linear-attention's chunked gated delta rule, or None when it cannot be imported."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or no triton (CPU-only torch)
        return None
    return chunk_gated_delta_rule


def is_packable_gdn(module: nn.Module) -> bool:
    return all(hasattr(module, name) for name in _GDN_PARTS)


def document_causal_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Depthwise causal conv1d + SiLU over a packed row, restarted at every document.

    x [S, C], weight [C, K] (tap K-1 is the current token), positions [S] -> [S, C].
    The whole row goes through one conv (the fast kernel, as transformers runs it); then only the
    first K-1 tokens of each document, the ones whose taps reached into the previous document, are
    computed again with those taps zeroed.
    """
    s, c = x.shape
    k = weight.shape[1]
    out = F.conv1d(x.T[None], weight[:, None, :].to(x.dtype), padding=k - 1, groups=c)[0, :, :s].T.contiguous()
    rows = torch.nonzero(positions < k - 1).flatten()
    exact = torch.zeros(rows.shape[0], c, dtype=torch.float32, device=x.device)
    for d in range(k):  # tap d reads token t-d, which is in t's document iff position[t] >= d
        inside = (positions[rows] >= d)[:, None]
        exact += x[(rows - d).clamp(min=0)].float() * weight[:, k - 1 - d].float() * inside
    out[rows] = exact.to(out.dtype)
    return F.silu(out)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_delta_rule(q, k, v, g, beta, state, keep_states: bool = False):
    """The gated delta rule token by token from `state` (fp32). Slow; CPU, tests and per-token states.

    q, k [T, H, Dk], v [T, H, Dv], g (log decay) and beta [T, H], state [H, Dk, Dv] ->
    (out [T, H, Dv], final state [H, Dk, Dv], the state after every token [T, H, Dk, Dv] or None).
    """
    out, final, states = batched_delta_rule(*(x[None] for x in (q, k, v, g, beta, state)), keep_states)
    return out[0], final[0], None if states is None else states[0]


def batched_delta_rule(q, k, v, g, beta, state, keep_states: bool = False):
    """recurrent_delta_rule for b sequences at once: q, k [b, T, H, Dk], v [b, T, H, Dv], g and beta
    [b, T, H], state [b, H, Dk, Dv] -> (out [b, T, H, Dv], final [b, H, Dk, Dv], states [b, T, ...] or None).
    A token with g = 0 and beta = 0 leaves the state as it is (no decay, no write): how a row's
    padding, or the rejected drafts of a block, are kept out of its state."""
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k, v, g, beta = _l2norm(k.float()), v.float(), g.float(), beta.float()
    out = torch.empty_like(v)
    states = v.new_empty(v.shape[0], v.shape[1], *state.shape[1:]) if keep_states else None
    for t in range(q.shape[1]):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], state)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        out[:, t] = torch.einsum("bhk,bhkv->bhv", q[:, t], state)
        if states is not None:
            states[:, t] = state
    return out, state, states


def token_by_token_delta_rule(q, k, v, g, beta, cu_seqlens) -> torch.Tensor:
    """The gated delta rule as defined, one token at a time (recurrent_delta_rule), restarted at each
    document (fp32): [S, H, Dv]. Slow: the definition that the chunked form below is checked against."""
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    bounds = cu_seqlens.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        zero = torch.zeros(q.shape[1], q.shape[2], v.shape[2], device=q.device)  # [H, Dk, Dv]
        out[a:b] = recurrent_delta_rule(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], zero)[0]
    return out


def reference_delta_rule(q, k, v, g, beta, cu_seqlens, chunk: int = 64) -> torch.Tensor:
    """The gated delta rule in chunks, restarted at each document (fp32): the CPU capture path.

    Same arguments and result as token_by_token_delta_rule, in the chunked (WY) form of
    transformers' torch_chunk_gated_delta_rule and fla's kernel. Every document is cut into pieces
    of at most `chunk` tokens, zero-padded at the end (a padded token changes no state: k = 0,
    decay 1); everything inside a piece runs for all pieces of the row at once, and only the state
    passed from one piece to the next is a loop, reset where a document begins.
    """
    scale = q.shape[-1] ** -0.5
    q, k = _l2norm(q.float()) * scale, _l2norm(k.float())
    v, g, beta = v.float(), g.float(), beta.float()
    bounds = cu_seqlens.tolist()
    chunk = min(chunk, max(b - a for a, b in zip(bounds[:-1], bounds[1:])))  # rows of short documents pad less
    pieces = [(s, min(chunk, b - s), s == a) for a, b in zip(bounds[:-1], bounds[1:]) for s in range(a, b, chunk)]
    starts = torch.tensor([p[0] for p in pieces], device=q.device)
    lens = torch.tensor([p[1] for p in pieces], device=q.device)
    offset = torch.arange(chunk, device=q.device)
    valid = offset[None] < lens[:, None]  # [N, C]
    index = torch.where(valid, starts[:, None] + offset[None], 0)

    def pieces_of(x):  # [S, H, ...] -> [N, H, C, ...], zero past each piece's end
        x = x[index] * valid.view(*valid.shape, *[1] * (x.dim() - 1))
        return x.transpose(1, 2)

    q, k, v, g, beta = (pieces_of(x) for x in (q, k, v, g, beta))
    g = g.cumsum(-1)  # [N, H, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # the WY form: T = (I + strictly-lower(beta k k^T decay))^-1 folds the in-piece recurrence
    eye = torch.eye(chunk, device=q.device)
    t = torch.linalg.solve_triangular(eye + (k_beta @ k.transpose(-1, -2) * decay).tril(-1), eye, upper=False)
    u = t @ (v * beta[..., None])  # [N, H, C, Dv]
    w = t @ (k_beta * g.exp()[..., None])  # [N, H, C, Dk]
    inside = q @ k.transpose(-1, -2) * decay  # [N, H, C, C]
    q_decayed = q * g.exp()[..., None]
    k_to_end = k * (g[..., -1:] - g).exp()[..., None]
    out = torch.empty_like(u)
    state = q.new_zeros(q.shape[1], q.shape[3], v.shape[3])  # [H, Dk, Dv]
    for i, (_, _, first) in enumerate(pieces):
        if first:
            state = torch.zeros_like(state)
        v_new = u[i] - w[i] @ state
        out[i] = q_decayed[i] @ state + inside[i] @ v_new
        state = state * g[i, :, -1].exp()[:, None, None] + k_to_end[i].transpose(-1, -2) @ v_new
    result = out.new_empty(int(bounds[-1]), out.shape[1], out.shape[3])
    result[index[valid]] = out.transpose(1, 2)[valid]
    return result


def _layout(row: RowSlot, x: torch.Tensor) -> RowLayout:
    # a plain forward of the model, not a capture: one document
    return row.layout if row.layout is not None else RowLayout.one_document(x.shape[0], x.device)


def conv_in_documents(row: RowSlot, x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    """The document-restarted conv on the row in flight, its output split in parts of `sizes` channels
    (q, k, v). Eager: document_causal_conv (one conv kernel, then the few tokens at document starts
    again). Compiled: the same sum of K shifted taps, each tap masked where it would reach into the
    previous document, part by part, so that each part is written once, contiguous (one conv, then
    the split, wrote them twice: 291 against 193 us for the 27B's [4096, 10240] on an H100); only
    the positions tensor [S] enters the graph, so no shape depends on the row's documents."""
    if torch.compiler.is_compiling():
        parts = zip(x.split(sizes, -1), weight.split(sizes, 0))
        return [masked_tap_conv(part, w, row.layout.positions) for part, w in parts]
    return list(_eager_conv(row, x, weight).split(sizes, -1))


@torch.compiler.disable
def _eager_conv(row: RowSlot, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return document_causal_conv(x, weight, _layout(row, x).positions)


def masked_tap_conv(x: torch.Tensor, weight: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """document_causal_conv as K shifted, masked taps (fp32): x [S, C], weight [C, K], positions [S]."""
    k = weight.shape[1]
    out = x.float() * weight[:, k - 1].float()
    for d in range(1, k):  # tap d reads token t-d, which is in t's document iff position[t] >= d
        back = F.pad(x[:-d], (0, 0, d, 0)).float()
        out = out + back * weight[:, k - 1 - d].float() * (positions >= d)[:, None]
    return F.silu(out.to(x.dtype))


@torch.compiler.disable
def rule_in_documents(row: RowSlot, kernel, q, k, v, g, beta) -> torch.Tensor:
    """The gated delta rule restarted at each document of the row in flight: [S, H, Dv]. The kernel
    takes q and k l2-normalized (PackedGatedDeltaNet.forward), the torch reference normalizes them."""
    cu = _layout(row, q).cu_seqlens
    if kernel is None:
        return reference_delta_rule(q, k, v, g, beta, cu)
    return kernel(q[None], k[None], v[None], g=g[None], beta=beta[None], cu_seqlens=cu)[0][0]


class PackedGatedDeltaNet(nn.Module):
    """Stands in for one Gated DeltaNet layer of the target; reads the row layout from `row`."""

    def __init__(self, layer: nn.Module, row: "RowSlot", kernel=None, index: int = 0):
        super().__init__()
        self.layer, self.row, self.kernel, self.index = layer, row, kernel, index
        self.recurrent_kernel = fla_recurrent_rule() if kernel is not None else None

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        m = self.layer
        if self.row.rows is not None:  # verify/slots.py: a batch of rows, each from its own state
            return self._rows(hidden_states, self.row.rows)
        if hidden_states.shape[0] != 1:
            raise ValueError(f"packed Gated DeltaNet takes one row at a time, got a batch of {hidden_states.shape[0]}")
        x = hidden_states[0]  # [S, hidden]
        if self.row.decode is not None:
            return self._decode(x, self.row.decode)[None]
        parts = conv_in_documents(self.row, m.in_proj_qkv(x), m.conv1d.weight[:, 0], self.sizes)
        q, k, v, g, beta = self._rule_inputs(x, parts, grouped=self.kernel is not None)
        if self.kernel is not None:
            # fla's kernel gets its key heads once (GVA), q and k l2-normalized in the compiled layer
            # (fused with the conv: fla's own l2norm was two more launches, ~0.45 ms of host time a
            # layer) and contiguous tensors (no eager copy in its input guard)
            q, k, v = _l2norm(q.float()).to(q.dtype), _l2norm(k.float()).to(k.dtype), v.contiguous()
        o = rule_in_documents(self.row, self.kernel, q, k, v, g, beta)
        return self._output(x, o)[None]

    @property
    def sizes(self) -> list[int]:
        """The conv output's parts: q, k, v channels."""
        return [self.layer.key_dim, self.layer.key_dim, self.layer.value_dim]

    def _rule_inputs(self, x, parts, grouped: bool = False):
        """The conv output's q, k, v parts [S, C_i] and the layer input [S, hidden] -> the delta
        rule's q, k, v, g, beta.

        q and k come with one head per value head, or with grouped=True with their key heads only:
        flash-linear-attention's chunked kernel shares each key head across its group of value
        heads itself (GVA), which spares writing and reading them num_v_heads / num_k_heads times."""
        m, s = self.layer, x.shape[0]
        q, k, v = parts
        q, k = q.reshape(s, m.num_k_heads, m.head_k_dim), k.reshape(s, m.num_k_heads, m.head_k_dim)
        v = v.reshape(s, m.num_v_heads, m.head_v_dim)
        if m.num_v_heads != m.num_k_heads and not grouped:  # each key head serves consecutive value heads
            q = q.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=1)
            k = k.repeat_interleave(m.num_v_heads // m.num_k_heads, dim=1)
        beta = m.in_proj_b(x).sigmoid()
        g = -m.A_log.float().exp() * F.softplus(m.in_proj_a(x).float() + m.dt_bias)
        return q, k, v, g, beta

    def _output(self, x, o):
        m, s = self.layer, x.shape[0]
        z = m.in_proj_z(x).reshape(s, m.num_v_heads, m.head_v_dim)
        o = m.norm(o.to(x.dtype).reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim))
        return m.out_proj(o.reshape(s, m.value_dim))

    def run_rule(self, q, k, v, g, beta, state):
        """The delta rule over one sequence from `state` -> (out [T, H, Dv], final state), kernel or torch."""
        if self.kernel is None:
            return recurrent_delta_rule(q, k, v, g, beta, state)[:2]
        few = self.recurrent_kernel is not None and q.shape[0] <= RECURRENT_TOKENS
        rule = self.recurrent_kernel if few else self.kernel
        o, final = rule(
            q[None],
            k[None],
            v[None],
            g=g[None],
            beta=beta[None],
            initial_state=state[None],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        return o[0], final[0]

    def states_per_token(self, q, k, v, g, beta, state):
        """The rule over a block from `state` -> (out [T, H, Dv], the state after every token [T, H, Dk, Dv]).

        With the fused recurrent kernel: one call over the T prefixes of the block as T sequences
        (lengths 1..T, each from `state`), whose final states are the states after each token and
        whose longest one gives the block's output; else token by token in torch.
        """
        if self.recurrent_kernel is None:
            out, _, states = recurrent_delta_rule(q, k, v, g, beta, state, keep_states=True)
            return out, states
        t = q.shape[0]
        index = torch.cat([torch.arange(n) for n in range(1, t + 1)]).to(q.device)
        cu = torch.tensor([n * (n + 1) // 2 for n in range(t + 1)], dtype=torch.long, device=q.device)
        o, states = self.recurrent_kernel(
            q[index][None],
            k[index][None],
            v[index][None],
            g=g[index][None],
            beta=beta[index][None],
            initial_state=state[None].expand(t, *state.shape).contiguous(),
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            cu_seqlens=cu,
        )
        return o[0, -t:], states

    def run_rows(self, q, k, v, g, beta, state):
        """The rule over b sequences [b, T, ...] from their states [b, H, Dk, Dv] -> (out, final states)."""
        if self.kernel is None:
            return batched_delta_rule(q, k, v, g, beta, state)[:2]
        few = self.recurrent_kernel is not None and q.shape[1] <= RECURRENT_TOKENS
        rule = self.recurrent_kernel if few else self.kernel
        return rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def _rows(self, x, states: "RowStates") -> torch.Tensor:
        """x [b, T, hidden]: the next T tokens of rows states.where, after each row's committed state."""
        m, (b, t, _) = self.layer, x.shape
        mixed = m.in_proj_qkv(x)  # [b, T, C]
        window = self._row_window(states, mixed)  # the K-1 inputs before, then T
        w = m.conv1d.weight[:, 0]
        qkv = F.silu(F.conv1d(window.transpose(1, 2), w[:, None, :].to(x.dtype), groups=w.shape[0]).transpose(1, 2))
        inputs = [
            y.unflatten(0, (b, t)) for y in self._rule_inputs(x.flatten(0, 1), qkv.flatten(0, 1).split(self.sizes, -1))
        ]
        o = self._row_rule(states, window, inputs)
        return self._output(x.flatten(0, 1), o.flatten(0, 1)).unflatten(0, (b, t))

    # The two halves that read and write the rows' states: eager, outside compiled layers (compiled.py)
    @torch.compiler.disable
    def _row_window(self, states: "RowStates", mixed: torch.Tensor) -> torch.Tensor:
        return torch.cat([states.conv[self.index][states.where], mixed], 1)

    @torch.compiler.disable
    def _row_rule(self, states: "RowStates", window: torch.Tensor, inputs: list[torch.Tensor]) -> torch.Tensor:
        i, rows = self.index, states.where
        state = states.recurrent[i][rows]
        if states.lengths is not None:  # a prefill: each row's first `lengths` tokens committed now
            o, states.recurrent[i][rows] = self.run_rows(*only_first(states.lengths, *inputs), state)
            states.conv[i][rows] = conv_after(window, states.lengths, states.conv[i].shape[1])
        else:  # a block: commit() keeps each row's accepted prefix of it
            o, _ = self.run_rows(*inputs, state)
            states.keep_block(i, window, inputs)
        return o

    def _decode(self, x, decode: "DecodeState") -> torch.Tensor:
        """Incremental decoding: x [T, hidden] are the tokens after the layer's state in `decode`."""
        m = self.layer
        state = decode.layers.get(self.index)
        if state is None:
            state = decode.layers[self.index] = LayerState.empty(m, x)
        mixed = m.in_proj_qkv(x)  # [T, C]
        window = torch.cat([state.conv, mixed])  # the K-1 inputs before, then T
        w = m.conv1d.weight[:, 0]
        qkv = F.silu(F.conv1d(window.T[None], w[:, None, :].to(x.dtype), groups=w.shape[0])[0].T)
        q, k, v, g, beta = self._rule_inputs(x, qkv.split(self.sizes, -1))
        if not decode.verifying:  # prefill: committed at once
            o, state.recurrent = self.run_rule(q, k, v, g, beta, state.recurrent)
            state.conv = window[mixed.shape[0] :]
        elif decode.rollback == "per-token":
            o, state.block_states = self.states_per_token(q, k, v, g, beta, state.recurrent)
        else:
            o, state.block_final = self.run_rule(q, k, v, g, beta, state.recurrent)
            state.block_inputs = (q, k, v, g, beta)
        state.block_conv = mixed if decode.verifying else None
        return self._output(x, o)


def install(layers: nn.ModuleList, kernel, slot: RowSlot) -> bool:
    """Swap every Gated DeltaNet of the decoder for the packed version reading `slot`; False if some
    recurrent layer is of a kind this module does not know (the caller then runs one document at a time)."""
    mixers = [getattr(layer, "linear_attn", None) for layer in layers]
    recurrent = [m for m in mixers if m is not None]
    if not recurrent or not all(is_packable_gdn(m) for m in recurrent):
        return False
    for i, (layer, mixer) in enumerate(zip(layers, mixers)):
        if mixer is not None:
            layer.linear_attn = PackedGatedDeltaNet(mixer, slot, kernel, index=i)
    return True
