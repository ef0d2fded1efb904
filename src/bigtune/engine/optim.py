"""Optimizers: torch AdamW/SGD, bitsandbytes 8-bit and paged Adam, and AdamW offloaded to CPU RAM."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

import torch

from bigtune.recipe import OptimConfig


class CPUOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose fp32 master weights and moments live in CPU RAM; the device keeps only the
    (possibly low-precision) parameters and their gradients.

    Each step copies the gradients to the CPU, updates the fp32 masters there (DeepSpeed's
    vectorised CPU Adam when installed, else torch's), and copies the result back. This trades a
    PCIe round trip per step for 12 bytes/parameter of device memory (ZeRO-Offload's idea, on one device).
    """

    offloaded = True

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas=(0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        use_deepspeed: bool = False,
    ):
        params = list(params)
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        pin = torch.cuda.is_available() and any(p.is_cuda for p in params)
        self.masters = []
        for p in params:
            m = torch.empty(p.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
            m.copy_(p.detach())
            m.grad = torch.zeros_like(m)
            self.masters.append(m)
        self._device_params = params
        if use_deepspeed:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            self.inner = DeepSpeedCPUAdam(
                self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adamw_mode=True
            )
        else:
            self.inner = torch.optim.AdamW(self.masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    def cpu_state_tensors(self) -> list[torch.Tensor]:
        out = list(self.masters) + [m.grad for m in self.masters if m.grad is not None]
        for st in self.inner.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.inner.param_groups:
            g["lr"] = self.param_groups[0]["lr"]  # the scheduler moves the outer group's lr
        for p, m in zip(self._device_params, self.masters):
            if p.grad is not None:
                m.grad.copy_(p.grad, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # gradients must have landed before the CPU reads them
        self.inner.step()
        for p, m in zip(self._device_params, self.masters):
            p.copy_(m, non_blocking=True)

    def state_dict(self) -> dict:
        return {
            "inner": self.inner.state_dict(),
            "masters": [m.detach() for m in self.masters],
            "lr": self.param_groups[0]["lr"],
        }

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        for m, saved in zip(self.masters, state["masters"]):
            m.copy_(saved)
        for g in self.param_groups:
            g["lr"] = state["lr"]


def make_optimizer(o: OptimConfig, model: torch.nn.Module, lr: float | None = None) -> torch.optim.Optimizer:
    """The optimizer over the model's trainable parameters (frozen ones get no state).

    ``lr`` is the peak lr to use when it differs from ``o.lr`` (Recipe.lr: scaled per optim.lr_scaling).
    With optim.in_backward, one such optimizer per parameter, stepped from the backward (InBackwardOptimizer).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    o = o if lr is None else dataclasses.replace(o, lr=lr)
    if o.in_backward:
        return InBackwardOptimizer(params, lambda ps: _optimizer(o, ps), o.lr)
    return _optimizer(o, params)


def _optimizer(o: OptimConfig, params: list) -> torch.optim.Optimizer:
    impl: dict[str, Any] = {}
    if o.implementation == "foreach":
        impl = {"foreach": True}
    elif o.implementation == "fused":
        impl = {"fused": True}
    elif o.implementation == "for-loop":
        impl = {"foreach": False}
    betas = tuple(o.betas)
    if o.name == "adamw":
        return torch.optim.AdamW(params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay, **impl)
    if o.name == "sgd":
        return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay, **impl)
    if o.name in ("adam8bit", "adamw8bit", "paged_adamw8bit"):
        import bitsandbytes as bnb

        cls = {
            "adam8bit": bnb.optim.Adam8bit,
            "adamw8bit": bnb.optim.AdamW8bit,
            "paged_adamw8bit": bnb.optim.PagedAdamW8bit,
        }[o.name]
        return cls(params, lr=o.lr, betas=betas, eps=o.eps, weight_decay=o.weight_decay)
    if o.name in ("cpu_offload_adamw", "deepspeed_cpu_adam"):
        return CPUOffloadAdamW(
            params,
            lr=o.lr,
            betas=betas,
            eps=o.eps,
            weight_decay=o.weight_decay,
            use_deepspeed=o.name == "deepspeed_cpu_adam",
        )
    raise ValueError(f"optim.name: unknown optimizer {o.name!r}")


class InBackwardOptimizer(torch.optim.Optimizer):
    """One optimizer per parameter, stepped from the backward pass as soon as that parameter's gradient
    is complete, which then frees the gradient (optim.in_backward; torchtune's optimizer_in_bwd idea).

    No full set of gradients ever exists: the step's peak loses the gradient bytes (a 16-bit copy of every
    trainable weight). The price: nothing can look at all gradients together, so there is no global-norm
    clipping, no gradient accumulation and no data parallelism (the recipe refuses those). ``step()`` only
    steps parameters whose gradient was set outside a backward (the planner's warm-up); the scheduler moves
    this optimizer's lr, which each parameter's step copies.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], make: Callable[[list], torch.optim.Optimizer], lr: float):
        params = list(params)
        super().__init__(params, {"lr": lr})
        self.inner = {p: make([p]) for p in params}
        self._alias_state()
        for p in params:
            p.register_post_accumulate_grad_hook(self._step_param)

    def _alias_state(self) -> None:
        # The memory monitor and checkpoints read optimizer.state: show each inner optimizer's own dict.
        for p, opt in self.inner.items():
            self.state[p] = opt.state[p]

    @torch.no_grad()
    def _step_param(self, p: torch.nn.Parameter) -> None:
        opt = self.inner[p]
        for g in opt.param_groups:
            g["lr"] = self.param_groups[0]["lr"]
        opt.step()
        p.grad = None

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for p in self.inner:
            if p.grad is not None:
                self._step_param(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.inner:
            p.grad = None

    def state_dict(self) -> dict:
        return {"inner": [opt.state_dict() for opt in self.inner.values()], "lr": self.param_groups[0]["lr"]}

    def load_state_dict(self, state: dict) -> None:
        for opt, saved in zip(self.inner.values(), state["inner"], strict=True):
            opt.load_state_dict(saved)
        self.state.clear()
        self._alias_state()
        for g in self.param_groups:
            g["lr"] = state["lr"]
