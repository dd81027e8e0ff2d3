"""float64 references of the advantage maths, written from the rules of docs/algorithm.md §2, §6, §7 (not from
the code they check)."""
import math


def ref_outcome(scores, groups, mode, eps=1e-6):
    out = []
    for s, g in zip(scores, groups):
        members = [x for x, h in zip(scores, groups) if h == g]
        if len(members) == 1:
            mu, sd = 0.0, 1.0
        else:
            mu = sum(members) / len(members)
            sd = math.sqrt(sum((x - mu) ** 2 for x in members) / (len(members) - 1))
        out.append(s - mu if mode == "mean_norm" else (s - mu) / (sd + eps))
    return out


def ref_tokens(a_out, lens, deltas, masks, lams, normalize, clip, eps=1e-6):
    """float64 per-token A = A_out + Σ_k λ_k Δ'_k, Δ'_k = Δ_k on samples routed to k (0 elsewhere), normalised over
    its routed tokens with the population σ and ε, then clipped."""
    out = [[a] * n for a, n in zip(a_out, lens)]
    for d, m, lam in zip(deltas, masks, lams):
        rows, at = [], 0
        for n in lens:
            rows.append([float(x) for x in d[at:at + n]])
            at += n
        vals = [v for r, on in zip(rows, m) if on for v in r]
        mu = sum(vals) / len(vals) if vals else 0.0
        sd = math.sqrt(sum((v - mu) ** 2 for v in vals) / len(vals)) if vals else 0.0
        for i, (r, on) in enumerate(zip(rows, m)):
            for j, v in enumerate(r):
                x = ((v - mu) / (sd + eps) if normalize else v) if on else 0.0
                if clip is not None:
                    x = max(-clip, min(clip, x))
                out[i][j] += lam * x
    return [v for r in out for v in r]
