"""The language model's products that share an input, stacked into one: q, k and v; gate and up.

Decode reads every weight once per token through batch-1 kernels, and each call pays its own start (thread team,
activation quantization for int8) and reads a short matrix at a lower rate than a tall one. Stacked, a layer is
4 products instead of 7, which measured faster in every precision (docs/decisions.md, "Stacked projections").

transformers' attention and MLP still call q_proj, k_proj and v_proj (gate_proj, up_proj) one after another on the
same tensor: each is a `StackedPart` that runs the stacked product at the first call and hands out its slice, and
its siblings' slices at theirs. The direct decode step calls the stacked product itself (`stacked_products`).
"""
from __future__ import annotations

import torch
from torch import nn

# owner module: (name of the stacked projection, the Linears it stacks)
GROUPS = {"self_attn": ("qkv_proj", ("q_proj", "k_proj", "v_proj")), "mlp": ("gate_up_proj", ("gate_proj", "up_proj"))}


class StackedProjection(nn.Module):
    """Several Linears on one input as one Linear over their weights stacked by rows; returns the parts."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        """linear: the product over the stacked weights; sizes: each part's rows, in order."""
        super().__init__()
        self.sizes, self.linear = list(sizes), linear
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()
        self._handed_out: set[int] = set()

    @classmethod
    def of(cls, linears: list[nn.Linear]) -> "StackedProjection":
        """One Linear over the weights of `linears`, stacked by rows."""
        weight = torch.cat([linear.weight.detach() for linear in linears])
        biases = [linear.bias for linear in linears]
        stacked = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta",
                            dtype=weight.dtype)
        stacked.weight = nn.Parameter(weight, requires_grad=False)
        if biases[0] is not None:
            stacked.bias = nn.Parameter(torch.cat([bias.detach() for bias in biases]), requires_grad=False)
        return cls(stacked, [linear.out_features for linear in linears])

    def parts(self) -> tuple["StackedPart", ...]:
        return tuple(StackedPart(self, index) for index in range(len(self.sizes)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).split(self.sizes, dim=-1)

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Part `index` of the product on `x`, computed once for the sibling calls on the same tensor and forgotten
        once every part has been handed out (a prefill's parts are not kept alive). A part asked for twice is a new
        product: the tensor may have been written in place between the calls."""
        if self._input is not x or index in self._handed_out:
            self._input, self._parts, self._handed_out = x, self(x), set()
        part = self._parts[index]
        self._handed_out.add(index)
        if len(self._handed_out) == len(self.sizes):
            self._input, self._parts = None, ()
        return part


class StackedPart(nn.Module):
    """Stands where one of the stacked Linears stood: its slice of the stacked product."""

    def __init__(self, stacked: StackedProjection, index: int):
        super().__init__()
        # Not a submodule: the stacked projection is registered once, beside its parts.
        object.__setattr__(self, "stacked", stacked)
        self.index = index
        self.in_features, self.out_features = stacked.linear.in_features, stacked.sizes[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stacked.part(x, self.index)

    def extra_repr(self) -> str:
        return f"part {self.index} of {self.stacked.sizes}"


def stack_projections_(model: nn.Module) -> int:
    """Stack each language-model layer's q, k, v and gate, up Linears, one layer at a time (the separate weights go
    as each stack is built), registered as `qkv_proj` and `gate_up_proj`. Returns how many stacks were built."""
    built = 0
    for layer in model.model.language_model.layers:
        for owner_name, (stacked_name, names) in GROUPS.items():
            owner = getattr(layer, owner_name)
            linears = [getattr(owner, name) for name in names]
            if not all(type(linear) is nn.Linear for linear in linears):
                continue
            stacked = StackedProjection.of(linears)
            owner.add_module(stacked_name, stacked)
            for name, part in zip(names, stacked.parts()):
                setattr(owner, name, part)
            for linear in linears:
                linear.weight = linear.bias = None
            built += 1
    return built


def stacked_products(modules: tuple[nn.Module, ...], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The products of `modules` on `x`: one stacked product if they are its parts, else one product each."""
    first = modules[0]
    if (isinstance(first, StackedPart) and len(modules) == len(first.stacked.sizes)
            and all(getattr(m, "stacked", None) is first.stacked and m.index == i for i, m in enumerate(modules))):
        return first.stacked(x)
    return tuple(module(x) for module in modules)
