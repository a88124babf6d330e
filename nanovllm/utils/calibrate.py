"""Error-compensated rounding (GPTQ, Frantar et al. 2022) for `nanovllm convert --quantize --calibrate`: each linear
layer's weights are rounded one input column at a time, and each column's rounding error is pushed onto the columns
not yet rounded, weighted by the layer's input statistics H = X^T X over calibration text. The output keeps the
format's layout (the same scales, codes and packing as round-to-nearest); only which grid points are chosen changes.

Calibration text: Python's own documentation (pydoc_data.topics, in every Python install), its last
CALIBRATION_TOKENS tokens, so no hub and no dataset is needed. Hessians come from the float model's activations (not
re-computed after each layer is quantized), all layers at once: about 13 MB per SmolLM2 layer, but about 0.6 GB per
8B layer, so this is for small models.
"""
from __future__ import annotations

import torch

CALIBRATION_TOKENS, CALIBRATION_WINDOW = 2048, 512
DAMPING = 0.01  # of H's mean diagonal, added to the diagonal (GPTQ's default): keeps H invertible
# columns rounded per block before the error is pushed onto the rest in one matmul: within a block every column
# updates all later ones elementwise (N x block / 2 per column), the costliest part of GPTQ on a CPU; 32 does a
# quarter of 128's elementwise work for the same result in exact arithmetic wherever groups start on a block
COLUMN_BLOCK = 32


def calibration_windows(tokenizer) -> list[list[int]]:
    """CALIBRATION_TOKENS tokens from the end of pydoc_data.topics (its topics in sorted order), in windows."""
    import pydoc_data.topics
    text = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    token_ids = tokenizer.encode(text)[-CALIBRATION_TOKENS:]
    return [token_ids[i:i + CALIBRATION_WINDOW] for i in range(0, len(token_ids), CALIBRATION_WINDOW)]


# linear layers that read the same input as another one: its H serves them too
SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


def collect_hessians(model_dir: str) -> dict[str, torch.Tensor]:
    """Checkpoint weight name (model.layers.0.mlp.down_proj.weight) -> H = X^T X / tokens [K, K] of its input, run
    through the float model with transformers in float32. Layers that read the same input share one tensor."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    windows = calibration_windows(AutoTokenizer.from_pretrained(model_dir))
    sums: dict[str, torch.Tensor] = {}
    handles, shared = [], {}
    for name, module in model.model.layers.named_modules(prefix="model.layers"):
        if not isinstance(module, torch.nn.Linear):
            continue
        parent, _, leaf = name.rpartition(".")
        if leaf in SHARED_INPUT:
            shared[f"{name}.weight"] = f"{parent}.{SHARED_INPUT[leaf]}.weight"
        else:
            handles.append(module.register_forward_hook(_accumulate(f"{name}.weight", sums)))
    with torch.no_grad():
        for window in windows:
            model.model(torch.tensor([window]))  # the decoder only: no LM head logits to compute
    for handle in handles:
        handle.remove()
    num_tokens = sum(len(w) for w in windows)
    hessians = {name: total / num_tokens for name, total in sums.items()}
    hessians.update({name: hessians[source] for name, source in shared.items()})
    return hessians


def _accumulate(name: str, sums: dict):
    def hook(module, inputs, output):
        x = inputs[0].reshape(-1, inputs[0].size(-1)).to(torch.float32)  # [tokens, K]
        sums[name] = sums.get(name, 0) + x.T @ x
    return hook


def gptq(w: torch.Tensor, hessian: torch.Tensor, group_size: int, fit, round_to_grid,
         factor: torch.Tensor | None = None) -> tuple[torch.Tensor, list]:
    """GPTQ's column loop. w [N, K] float32; group_size divides K. fit(values [..., N, group_size]) -> the group's
    grid parameters, taken from the group's values as they are when its first column is reached (a group that starts
    inside a COLUMN_BLOCK and runs past it sees its later columns before they take that block's errors: a less
    exact fit, still a grid every column is rounded to); round_to_grid(column [..., N], params) -> the column on the
    grid. factor: inverse_factor(hessian), if the caller has it already (layers that read one input share it).
    Returns the weight on the grid [N, K] and each group's parameters."""
    [w], [params] = gptq_batch([w], [hessian], group_size, fit, round_to_grid, None if factor is None else [factor])
    return w, params


def gptq_batch(ws: list[torch.Tensor], hessians: list[torch.Tensor], group_size: int, fit, round_to_grid,
               factors: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor], list[list]]:
    """gptq of several weights of one shape (one projection of several layers), each with its own Hessian, in one
    column loop: each column's ops run on all of them at once ([B, N] columns of [B, block columns, N] tensors), so a
    CPU pays the per-op overhead once per column, not once per layer. Every value is computed as for one weight
    alone: the ops are elementwise, and each weight's error is pushed onto its later columns by its own matmul."""
    ws = [w.clone() for w in ws]
    for w, hessian in zip(ws, hessians):
        w[:, torch.diag(hessian) == 0] = 0  # inputs that were always zero: their weights do not matter
    hinvs = factors if factors is not None else [inverse_factor(hessian) for hessian in hessians]
    params, k = [], ws[0].size(1)
    for start in range(0, k, COLUMN_BLOCK):
        end = min(start + COLUMN_BLOCK, k)
        # [B, columns, N]: a column is a contiguous row of it, so each op runs over all N outputs in one inner loop
        block = torch.stack([w[:, start:end].t() for w in ws])
        errors, hinv_block = torch.empty_like(block), torch.stack([h[start:end, start:end] for h in hinvs])
        pivots = hinv_block.diagonal(dim1=1, dim2=2).t().unsqueeze(-1).contiguous()  # [columns, B, 1]
        for i in range(end - start):
            if (start + i) % group_size == 0:
                in_block = block[:, i:i + group_size]  # the group's columns, those past the block from w
                past = torch.stack([w[:, end:end + group_size - in_block.size(1)].t() for w in ws])
                params.append(fit(torch.cat([in_block, past], dim=1).transpose(1, 2)))
            column, error = block[:, i], errors[:, i]
            rounded = round_to_grid(column, params[-1])
            torch.sub(column, rounded, out=error).div_(pivots[i])
            block[:, i:] -= hinv_block[:, i, i:].unsqueeze(2) * error.unsqueeze(1)
            column.copy_(rounded)
        for w, hinv, w_block, w_errors in zip(ws, hinvs, block, errors):
            w[:, start:end] = w_block.t()
            w[:, end:] -= w_errors.t().contiguous() @ hinv[start:end, end:]
    return ws, [[select(group, b) for group in params] for b in range(len(ws))]


def select(params, index):
    """One part of a group's grid parameters (a tensor, or a tuple of them, with rows last): params[index]."""
    return tuple(p[index] for p in params) if isinstance(params, tuple) else params[index]


def inverse_factor(hessian: torch.Tensor) -> torch.Tensor:
    """The upper Cholesky factor [K, K] float32 of the damped H's inverse, GPTQ's weights for pushing a column's
    error onto the later ones. An input that was always zero (H's diagonal 0) gets a diagonal of 1 first."""
    h = hessian.to(torch.float64).clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    h += DAMPING * torch.mean(torch.diag(h)) * torch.eye(h.size(0), dtype=torch.float64)
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True).to(torch.float32)


def inverse_factors(hessians: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """inverse_factor of every Hessian, by weight name, each shared tensor factored once: for callers that quantize
    one checkpoint into several formats (the factorizations cost more than a format's rounding on a CPU). As large
    as the Hessians themselves."""
    by_id: dict[int, torch.Tensor] = {}
    for hessian in hessians.values():
        if id(hessian) not in by_id:
            by_id[id(hessian)] = inverse_factor(hessian)
    return {name: by_id[id(hessian)] for name, hessian in hessians.items()}
