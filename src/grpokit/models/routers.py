"""A mixture-of-experts model's routers, read during the policy's training pass for the
load-balancing loss (algorithm.router_aux_loss_coef, algorithm/load_balancing.py).

The model's own `output_router_logits` would have its forward add transformers' auxiliary loss over
that one call's tokens (with its padding, its shared prompts, whatever the micro-batches): grpokit
turns it off (`quiet_routers`) and reads the router logits itself, with hooks on the router modules
the model names (transformers' `_can_record_outputs["router_logits"]`), at the same positions as
the log-probs: those that predict a completion's tokens.
"""

from __future__ import annotations

import torch


def router_modules(model) -> tuple[list[tuple[str, torch.nn.Module]], int]:
    """A mixture-of-experts model's routers, (name, module) each, and the index of their logits in a
    router's output, as the model records them (transformers' `_can_record_outputs["router_logits"]`,
    read from the first module inside that declares one); no routers: ([], 0)."""
    recorder = next((r for m in model.modules() if (r := (getattr(type(m), "_can_record_outputs", None) or {})
                                                     .get("router_logits")) is not None), None)
    if recorder is None:
        return [], 0
    target, index = (recorder, 0) if isinstance(recorder, type) else (
        recorder.target_class or recorder.class_name, recorder.index)

    def routes(module) -> bool:
        return isinstance(module, target) if isinstance(target, type) else type(module).__name__.endswith(target)

    return [(name, m) for name, m in model.named_modules() if routes(m)], index


def routed_choices(config) -> tuple[int, int] | None:
    """(experts, experts per token) of a model whose config has `output_router_logits` (a model
    whose routers' logits it can return: what TRL asks of a model to add its load-balancing loss),
    or None."""
    text = config.get_text_config(decoder=True)
    if not hasattr(text, "output_router_logits"):
        return None
    experts = next((getattr(text, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                    if getattr(text, k, None)), None)
    return (experts, text.num_experts_per_tok) if experts else None


def quiet_routers(model) -> None:
    """The model's forward returns no router logits and adds no auxiliary loss of its own (see the
    module docstring); the decoding steps' 2D masks would not fit its padding mask anyway."""
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "output_router_logits", False):
        text.output_router_logits = False


class RouterLogits:
    """Records the router logits of `model`'s forward calls while open: `take(keep)` gives the last
    call's (layers, B, keep, E), of its last `keep` positions (0: all)."""

    def __init__(self, model):
        self.model = model
        self.routers, self.index = router_modules(model)
        if not self.routers:
            raise ValueError(f"{type(model).__name__} declares no routers whose logits it records")
        self._hooks, self._layers, self._shape = [], [], None

    def __enter__(self) -> RouterLogits:
        decoder = self.model.get_decoder()
        self._hooks.append(decoder.register_forward_pre_hook(self._call, with_kwargs=True))
        self._hooks += [m.register_forward_hook(self._routed) for _, m in self.routers]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks, self._layers = [], []

    def _call(self, module, args, kwargs) -> None:
        inputs = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
        self._shape, self._layers = tuple(inputs.shape[:2]), []

    def _routed(self, module, args, output) -> None:
        self._layers.append(output[self.index] if isinstance(output, (tuple, list)) else output)  # (B * L, E)

    def take(self, keep: int = 0) -> torch.Tensor:
        """The last forward call's router logits (layers, B, L', E), L' its last `keep` positions (0: all)."""
        B, L = self._shape
        logits = torch.stack(self._layers).view(len(self._layers), B, L, -1)
        return logits[:, :, -keep:] if keep else logits
