"""Fork layout for shared-prefix multi-context scoring (DESIGN.md "The fork layout") — numpy reference.

A *context* is the full token list of one prompt + its response; `resp_len` says how many of its last tokens are
the response. A step-sample has one or more contexts (original, +episode skill, +step skill, ...) that share at
least the tokens before the skill insertion point. One packed *group* is

    [ prefix | branch 1 | branch 2 | ... ]

where the prefix is the longest token prefix shared by all contexts of the group (never longer than the shortest
prompt of the group) and branch b holds the rest of context b (its own prompt tokens, the tail, the response).
Positions: prefix 0..P-1, every branch continues from P. `branch_ids`: 0 on the prefix, b >= 1 on branch b.
Attention (kernels/fork_attention): token i sees token j of the same group iff j <= i and
(branch_ids[j] == 0 or branch_ids[j] == branch_ids[i]). This equals scoring each context as its own sequence.

Log-prob gather: row r predicts the token at r+1 of its branch; the first response token of a branch that has no
own tokens before it is predicted by the prefix's last row (so rows may repeat across branches).

Samples whose own shared prefix is token-identical (step 0 of all trajectories of a GRPO group, any identical
prompts) are merged into one group (`share_prompts=True`), so the prompt is computed once for all of them.
`plain=True` is the training layout: one context per sample, the whole sequence is the "prefix" (branch ids all 0).

Inputs are CSR ("flat values + offsets"): `tokens` int32 [T] (every context, sample by sample; int64 is accepted
when every id fits in int32),
`ctx_offsets` int64 [C+1] (context c is tokens[ctx_offsets[c]:ctx_offsets[c+1]]), `resp_lens` int64 [C],
`sample_offsets` int64 [S+1] (sample s owns contexts sample_offsets[s]:sample_offsets[s+1]).
`flatten_contexts` builds them from Python lists. Packed outputs hold token ids, positions and gather rows/targets
as int32: half the host memory traffic and the host-to-device copy of int64 (`PackedBatch.from_micro_batch`
widens them on the device side of the copy). The C++ extension (opid_mega._C) implements the same functions
with byte-identical outputs; `opid_mega.batching` picks it when importable.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

MAX_INT32 = 2**31 - 1
INT32_MIN = -(2**31)


@dataclass
class ContextBatch:
    """Ragged contexts in CSR form (see the module docstring)."""

    tokens: np.ndarray
    ctx_offsets: np.ndarray
    resp_lens: np.ndarray
    sample_offsets: np.ndarray

    @property
    def num_samples(self) -> int:
        return len(self.sample_offsets) - 1

    @property
    def num_contexts(self) -> int:
        return len(self.ctx_offsets) - 1


def flatten_contexts(samples: Sequence[Sequence[Tuple[Sequence[int], int]]]) -> ContextBatch:
    """`samples[s]` is a list of contexts `(token_ids_of_prompt_plus_response, resp_len)` -> CSR `ContextBatch`."""
    ctx_lens: List[int] = []
    resp_lens: List[int] = []
    per_sample: List[int] = []
    pieces: List[np.ndarray] = []
    for s, contexts in enumerate(samples):
        per_sample.append(len(contexts))
        for c, item in enumerate(contexts):
            if len(item) != 2:
                raise ValueError(f"flatten_contexts: sample {s} context {c} must be (token_ids, resp_len)")
            toks, r = item
            arr = np.asarray(toks, dtype=np.int64).reshape(-1)
            bad = np.flatnonzero((arr < INT32_MIN) | (arr > MAX_INT32))
            if bad.size:
                raise ValueError(f"flatten_contexts: sample {s} context {c} token {int(bad[0])} = "
                                 f"{int(arr[bad[0]])} does not fit in int32")
            pieces.append(arr.astype(np.int32))
            ctx_lens.append(arr.size)
            resp_lens.append(int(r))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, np.int32)
    ctx_offsets = np.zeros(len(ctx_lens) + 1, np.int64)
    np.cumsum(ctx_lens, out=ctx_offsets[1:])
    sample_offsets = np.zeros(len(per_sample) + 1, np.int64)
    np.cumsum(per_sample, out=sample_offsets[1:])
    return ContextBatch(tokens, ctx_offsets, np.asarray(resp_lens, np.int64).reshape(-1), sample_offsets)


def csr_offsets(lens) -> np.ndarray:
    """int64 [n+1] offsets of rows with `lens` values each."""
    lens = np.asarray(lens, np.int64)
    out = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=out[1:])
    return out


def csr_ranges(starts, lens) -> np.ndarray:
    """Concatenation of arange(starts[i], starts[i] + lens[i]) over i (int64), vectorised."""
    starts, lens = np.asarray(starts, np.int64), np.asarray(lens, np.int64)
    total = int(lens.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    return np.repeat(starts - csr_offsets(lens)[:-1], lens) + np.arange(total, dtype=np.int64)


def skill_contexts(tokens, seq_offsets, prompt_lens, skill_offsets, insert_at, section_offsets,
                   section_tokens, drop=None) -> ContextBatch:
    """The fork-layout contexts of step-samples from their skill insertion points, with no per-token Python.

    Sample s is sequence `tokens[seq_offsets[s]:seq_offsets[s+1]]`, its first `prompt_lens[s]` tokens the prompt;
    it owns skill contexts `skill_offsets[s]:skill_offsets[s+1]`, and skill context e inserts section e
    (`section_tokens[section_offsets[e]:section_offsets[e+1]]`) into the prompt before token `insert_at[e]`.
    Result: per sample its original context (the sequence), then `prompt[:at] + section + prompt[at:] + response`
    for each of its skill contexts in order; every context's resp_len is the sample's response length. The one
    place the insertion rule becomes tokens: the scorers and the training micro-batches both come through here.

    `drop[e]` (int64 [E], default all 0): leading tokens cut from skill context e after the insertion (the
    reference's left truncation of the augmented prompt to its last max_prompt_length tokens), taken from the head,
    then the section, then the rest of the prompt; at least one prompt token must remain."""
    tokens = np.ascontiguousarray(tokens)
    if tokens.dtype not in (np.int32, np.int64):
        raise TypeError(f"tokens must have dtype int32 or int64, got {tokens.dtype}")
    seq_offsets, prompt_lens, skill_offsets, insert_at, section_offsets = (
        np.ascontiguousarray(x, np.int64) for x in (seq_offsets, prompt_lens, skill_offsets, insert_at,
                                                    section_offsets))
    section_tokens = np.ascontiguousarray(section_tokens, tokens.dtype)
    check_offsets("seq_offsets", seq_offsets, tokens.size, "tokens")
    S = seq_offsets.size - 1
    seq_lens = np.diff(seq_offsets)
    if prompt_lens.shape != (S,):
        raise ValueError(f"prompt_lens has shape {prompt_lens.shape}, expected ({S},)")
    bad = np.flatnonzero((prompt_lens < 1) | (prompt_lens > seq_lens))
    if bad.size:
        s = int(bad[0])
        raise ValueError(f"prompt_lens[{s}]={int(prompt_lens[s])} must be in [1, {int(seq_lens[s])}] (the "
                         "sequence's length; a context needs at least one prompt token)")
    if skill_offsets.shape != (S + 1,):
        raise ValueError(f"skill_offsets has shape {skill_offsets.shape}, expected ({S + 1},)")
    E = int(skill_offsets[-1]) if S >= 0 else 0
    check_offsets("skill_offsets", skill_offsets, E, "skill contexts")
    if insert_at.shape != (E,):
        raise ValueError(f"insert_at has shape {insert_at.shape}, expected ({E},) (one per skill context)")
    if section_offsets.shape != (E + 1,):
        raise ValueError(f"section_offsets has shape {section_offsets.shape}, expected ({E + 1},)")
    check_offsets("section_offsets", section_offsets, section_tokens.size, "section tokens")
    n_skill = np.diff(skill_offsets)
    owner = np.repeat(np.arange(S, dtype=np.int64), n_skill)  # the sample of each skill context
    bad = np.flatnonzero((insert_at < 0) | (insert_at > prompt_lens[owner]))
    if bad.size:
        e = int(bad[0])
        raise ValueError(f"insert_at[{e}]={int(insert_at[e])} lies outside the prompt of sample {int(owner[e])} "
                         f"(0..{int(prompt_lens[owner[e]])})")
    sec_lens = np.diff(section_offsets)
    drop = np.zeros(E, np.int64) if drop is None else np.ascontiguousarray(drop, np.int64)
    if drop.shape != (E,):
        raise ValueError(f"drop has shape {drop.shape}, expected ({E},) (one per skill context)")
    bad = np.flatnonzero((drop < 0) | (drop >= prompt_lens[owner] + sec_lens))
    if bad.size:
        e = int(bad[0])
        raise ValueError(f"drop[{e}]={int(drop[e])} must be in [0, {int(prompt_lens[owner[e]] + sec_lens[e]) - 1}] "
                         "(the augmented prompt's length - 1: a context keeps at least one prompt token)")
    # the cut, piece by piece: the head first, then the section, then the rest of the prompt
    cut_head = np.minimum(drop, insert_at)
    cut_sec = np.minimum(drop - cut_head, sec_lens)
    cut_rest = drop - cut_head - cut_sec
    # Pieces in output order: per sample [its sequence] then, per skill context, [prompt head | section | rest].
    # Positions of the pieces in a pool [tokens | section_tokens].
    n_pieces = 1 + 3 * n_skill
    piece0 = csr_offsets(n_pieces)[:-1]  # each sample's first piece
    starts = np.zeros(int(n_pieces.sum()), np.int64)
    lens = np.zeros_like(starts)
    starts[piece0], lens[piece0] = seq_offsets[:-1], seq_lens
    head = piece0[owner] + 1 + 3 * (np.arange(E, dtype=np.int64) - skill_offsets[:-1][owner])
    seq0 = seq_offsets[:-1][owner]
    starts[head], lens[head] = seq0 + cut_head, insert_at - cut_head
    starts[head + 1], lens[head + 1] = tokens.size + section_offsets[:-1] + cut_sec, sec_lens - cut_sec
    starts[head + 2], lens[head + 2] = seq0 + insert_at + cut_rest, seq_lens[owner] - insert_at - cut_rest
    pool = np.concatenate([tokens, section_tokens]) if section_tokens.size else tokens
    out = np.ascontiguousarray(pool[csr_ranges(starts, lens)])
    ctx_lens = np.zeros(S + E, np.int64)
    ctx_of_sample = csr_offsets(1 + n_skill)
    ctx_lens[ctx_of_sample[:-1]] = seq_lens
    skill_ctx = np.ones(S + E, bool)
    skill_ctx[ctx_of_sample[:-1]] = False
    ctx_lens[skill_ctx] = seq_lens[owner] + sec_lens - drop
    resp = np.repeat(seq_lens - prompt_lens, 1 + n_skill)
    return ContextBatch(out, csr_offsets(ctx_lens), resp, ctx_of_sample)


# ----------------------------------------------------------------------------------------------- validation
def check_array(name: str, arr, dtypes: Tuple[type, ...], length: Optional[int] = None) -> np.ndarray:
    """Require a 1-D C-contiguous numpy array of one of `dtypes` (no silent casts: they would copy)."""
    if not isinstance(arr, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(arr).__name__}")
    if arr.dtype not in [np.dtype(d) for d in dtypes]:
        allowed = ", ".join(np.dtype(d).name for d in dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not arr.flags.c_contiguous:
        raise ValueError(f"{name} must be contiguous")
    if length is not None and arr.size != length:
        raise ValueError(f"{name} has length {arr.size}, expected {length}")
    return arr


def check_offsets(name: str, offsets: np.ndarray, total: int, what: str) -> None:
    """offsets[0] == 0, non-decreasing, offsets[-1] == total."""
    if offsets.size < 1:
        raise ValueError(f"{name} must have at least one entry (0)")
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(offsets[0])}")
    if offsets.size > 1 and bool(np.any(offsets[1:] < offsets[:-1])):
        i = int(np.flatnonzero(offsets[1:] < offsets[:-1])[0])
        raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}]={int(offsets[i + 1])} < "
                         f"{name}[{i}]={int(offsets[i])}")
    if offsets[-1] != total:
        raise ValueError(f"{name}[-1]={int(offsets[-1])} must equal the number of {what} ({total})")


def check_contexts(tokens, ctx_offsets, resp_lens, sample_offsets, plain: bool = False) -> None:
    """Validate a CSR context batch; raises TypeError/ValueError naming the offending argument."""
    check_array("tokens", tokens, (np.int32, np.int64))
    check_array("ctx_offsets", ctx_offsets, (np.int64,))
    check_array("sample_offsets", sample_offsets, (np.int64,))
    check_offsets("ctx_offsets", ctx_offsets, tokens.size, "tokens")
    num_ctx = ctx_offsets.size - 1
    check_array("resp_lens", resp_lens, (np.int64,), num_ctx)
    check_offsets("sample_offsets", sample_offsets, num_ctx, "contexts")
    if sample_offsets.size > 1 and bool(np.any(sample_offsets[1:] == sample_offsets[:-1])):
        s = int(np.flatnonzero(sample_offsets[1:] == sample_offsets[:-1])[0])
        raise ValueError(f"sample_offsets: sample {s} has no context")
    lens = np.diff(ctx_offsets)
    bad = np.flatnonzero((resp_lens < 0) | (resp_lens >= lens))
    if bad.size:
        c = int(bad[0])
        raise ValueError(f"resp_lens[{c}]={int(resp_lens[c])} must be in [0, context length - 1] "
                         f"(context length {int(lens[c])}: a context needs at least one prompt token)")
    if plain and sample_offsets.size > 1:
        multi = np.flatnonzero(np.diff(sample_offsets) != 1)
        if multi.size:
            raise ValueError(f"sample_offsets: plain layout needs exactly one context per sample, sample "
                             f"{int(multi[0])} has {int(np.diff(sample_offsets)[multi[0]])}")


def check_token_range(tokens) -> None:
    """Packed token ids are int32: int64 input must fit. (The builders check this last, after every other error,
    because the C++ one checks while it copies.)"""
    if tokens.dtype == np.int64 and tokens.size:
        bad = np.flatnonzero((tokens < INT32_MIN) | (tokens > MAX_INT32))
        if bad.size:
            raise ValueError(f"tokens[{int(bad[0])}]={int(tokens[bad[0]])} does not fit in int32 (packed token ids "
                             "are int32)")


# ----------------------------------------------------------------------------------------------- layout
def sample_prefix_lengths(tokens, ctx_offsets, resp_lens, sample_offsets, plain: bool = False) -> np.ndarray:
    """Per sample: longest token prefix shared by all its contexts, capped at its shortest prompt.

    `plain`: the whole (single) context is the prefix.
    """
    num_samples = sample_offsets.size - 1
    out = np.zeros(num_samples, np.int64)
    for s in range(num_samples):
        c0, c1 = int(sample_offsets[s]), int(sample_offsets[s + 1])
        if plain:
            out[s] = ctx_offsets[c0 + 1] - ctx_offsets[c0]
            continue
        prompt_lens = ctx_offsets[c0 + 1:c1 + 1] - ctx_offsets[c0:c1] - resp_lens[c0:c1]
        p = int(prompt_lens.min())
        first = tokens[ctx_offsets[c0]:ctx_offsets[c0] + p]
        for c in range(c0 + 1, c1):
            other = tokens[ctx_offsets[c]:ctx_offsets[c] + p]
            diff = np.flatnonzero(first[:p] != other)
            if diff.size:
                p = int(diff[0])
        out[s] = p
    return out


def fork_sample_bound(max_prompt_tokens: int, max_response_tokens: int, section_tokens: Sequence[int]) -> int:
    """The most tokens one step-sample can need in the fork layout: its original context and one context per skill
    section, each at most prompt + section + response long, none sharing a prefix (a section inserted at the very
    start): (1 + len(sections)) * (prompt + response) + sum(sections). A scoring budget of at least this never
    refuses a sample (`group_samples` raises for a sample larger than the budget)."""
    bad = [v for v in (max_prompt_tokens, max_response_tokens, *section_tokens) if int(v) != v or v < 0]
    if bad:
        raise ValueError(f"fork_sample_bound: token counts must be integers >= 0, got {bad[0]!r}")
    return (1 + len(section_tokens)) * (int(max_prompt_tokens) + int(max_response_tokens)) + int(sum(section_tokens))


def sample_group_tokens(ctx_offsets, sample_offsets, prefix_lens) -> np.ndarray:
    """Tokens one sample needs alone in the fork layout: P + sum over its contexts of (len - P)."""
    lens = np.diff(ctx_offsets)
    per_sample_total = np.add.reduceat(lens, sample_offsets[:-1]) if lens.size else np.zeros(0, np.int64)
    n_ctx = np.diff(sample_offsets)
    return (per_sample_total - (n_ctx - 1) * prefix_lens).astype(np.int64)


@dataclass
class Groups:
    """Samples grouped under one shared prefix. Group g holds samples
    `samples[sample_offsets[g]:sample_offsets[g+1]]` (ascending), prefix length `prefix_lens[g]`,
    `num_tokens[g]` packed tokens."""

    sample_offsets: np.ndarray
    samples: np.ndarray
    prefix_lens: np.ndarray
    num_tokens: np.ndarray

    @property
    def num_groups(self) -> int:
        return len(self.sample_offsets) - 1


def group_samples(tokens, ctx_offsets, sample_offsets, prefix_lens, max_group_tokens: int,
                  share_prompts: bool = True) -> Groups:
    """Merge samples whose own prefixes are token-identical (and non-empty) into one group, in sample order.

    A group is closed when the next sample would push it past `max_group_tokens`; the next sample with that
    prefix opens a new group. A single sample larger than `max_group_tokens` is an error naming it.
    """
    sizes = sample_group_tokens(ctx_offsets, sample_offsets, prefix_lens)
    group_of_key: Dict[bytes, int] = {}
    members: List[List[int]] = []
    g_prefix: List[int] = []
    g_tokens: List[int] = []
    for s in range(sizes.size):
        size = int(sizes[s])
        if size > max_group_tokens:
            raise ValueError(f"sample {s} needs {size} tokens, more than the micro-batch budget {max_group_tokens}")
        p = int(prefix_lens[s])
        if share_prompts and p > 0:
            start = int(ctx_offsets[sample_offsets[s]])
            key = tokens[start:start + p].tobytes()
            g = group_of_key.get(key)
            if g is not None and g_tokens[g] + size - p <= max_group_tokens:
                members[g].append(s)
                g_tokens[g] += size - p
                continue
            group_of_key[key] = len(members)
        members.append([s])
        g_prefix.append(p)
        g_tokens.append(size)
    offsets = np.zeros(len(members) + 1, np.int64)
    np.cumsum([len(m) for m in members], out=offsets[1:])
    flat = np.array([s for m in members for s in m], dtype=np.int64)
    return Groups(offsets, flat, np.array(g_prefix, np.int64), np.array(g_tokens, np.int64))


def fill_micro_batch(tokens, ctx_offsets, resp_lens, sample_offsets, groups: Groups, group_ids: Sequence[int],
                     token_values=None, value_offsets=None, plain: bool = False) -> dict:
    """Pack the given groups (in this order) into one micro-batch.

    Returns int32 tokens/position_ids/branch_ids [N], cu_seqlens [G+1], gather_rows/gather_targets [M] (rows
    local to this micro-batch), loss_mask bool [N] (plain only: True on rows that predict a response token), per context
    `ctx_gather_start` (local offset into M, dict context -> start), and `gather_values` float32 [M] when
    `token_values` (float32 per response token, CSR by `value_offsets` per context) is given.
    """
    tok_parts, pos_parts, br_parts = [], [], []
    rows_parts, tgt_parts, val_parts = [], [], []
    cu = [0]
    ctx_start: Dict[int, int] = {}
    row = 0
    m = 0
    for g in group_ids:
        p = int(groups.prefix_lens[g])
        gstart = row
        members = groups.samples[groups.sample_offsets[g]:groups.sample_offsets[g + 1]]
        first = int(ctx_offsets[sample_offsets[members[0]]])
        tok_parts.append(tokens[first:first + p])
        pos_parts.append(np.arange(p, dtype=np.int32))
        br_parts.append(np.zeros(p, np.int32))
        row += p
        branch = 0
        for s in members:
            for c in range(int(sample_offsets[s]), int(sample_offsets[s + 1])):
                branch += 1
                o = int(ctx_offsets[c])
                length = int(ctx_offsets[c + 1]) - o
                r = int(resp_lens[c])
                own = length - p
                tok_parts.append(tokens[o + p:o + length])
                pos_parts.append(np.arange(p, length, dtype=np.int32))
                br_parts.append(np.full(own, 0 if plain else branch, np.int32))
                q = np.arange(length - r, length, dtype=np.int64)   # context positions of the response
                rows_parts.append(np.where(q - 1 >= p, row + q - 1 - p, gstart + q - 1))
                tgt_parts.append(tokens[o + length - r:o + length])
                if token_values is not None:
                    val_parts.append(token_values[value_offsets[c]:value_offsets[c + 1]])
                ctx_start[c] = m
                m += r
                row += own
        cu.append(row)
    cat32 = lambda parts: (np.concatenate(parts).astype(np.int32, copy=False) if parts  # noqa: E731
                           else np.zeros(0, np.int32))
    out = {
        "tokens": cat32(tok_parts),
        "position_ids": cat32(pos_parts),
        "branch_ids": cat32(br_parts),
        "cu_seqlens": np.array(cu, np.int32),
        "gather_rows": cat32(rows_parts),
        "gather_targets": cat32(tgt_parts),
        "ctx_gather_start": ctx_start,
    }
    if plain:
        loss_mask = np.zeros(row, np.bool_)
        loss_mask[out["gather_rows"]] = True
        out["loss_mask"] = loss_mask
    if token_values is not None:
        vals = np.concatenate(val_parts).astype(np.float32) if val_parts else np.zeros(0, np.float32)
        out["gather_values"] = vals
    return out


def shared_fraction(num_naive_tokens: int, num_packed_tokens: int) -> float:
    """Fraction of the naive tokens (every context as its own sequence) that the fork layout does not compute."""
    if num_naive_tokens == 0:
        return 0.0
    return 1.0 - num_packed_tokens / num_naive_tokens


def unpack_logprobs(flat, ctx_gather_start, resp_lens, sample_offsets) -> List[List[np.ndarray]]:
    """`flat[M]` (one value per gathered row, e.g. log-probs) -> `out[sample][context]` arrays of resp_len values.

    `ctx_gather_start[c]` is where context c's values start in `flat` (global over all micro-batches when
    `flat` is their concatenation). Returns views into `flat` where it is a numpy array.
    """
    out: List[List[np.ndarray]] = []
    for s in range(len(sample_offsets) - 1):
        row = []
        for c in range(int(sample_offsets[s]), int(sample_offsets[s + 1])):
            start = int(ctx_gather_start[c])
            row.append(flat[start:start + int(resp_lens[c])])
        out.append(row)
    return out
