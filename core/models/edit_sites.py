"""Where a family applies :class:`core.forward.edits.Edit` s: the sites it has, and
the hooks that change a head's ``z`` slice, an MLP output, the residual
entering a layer, a visual-feature site, or knock attention edges out. Mixed
into :class:`core.models.adapter.Adapter`; the modules come from the family's
canonical ``z_module`` / ``mlp_module`` / ``layer_module`` / ``attention_module``."""

from __future__ import annotations

from typing import ClassVar

import torch

from core.errors import InterventionError


class EditSites:
    """The edit sites of one family and the hooks that apply edits there."""

    # ---- the modules hooks and interventions reach (hook-based families)
    def visual_site_module(self, site: str) -> tuple[torch.nn.Module, str]:
        """``(module, "pre" | "fwd")``: the module whose first input ("pre") or
        output ("fwd") is the visual-feature site ``site`` ("vision_out",
        "projector_out") ``(batch, n_visual, width)``."""
        raise InterventionError(f"{self.family}: no {site!r} site (edit sites: {', '.join(self.edit_sites)})")

    # The edit sites (core.forward.edits.SITES) this family applies; others are refused.
    edit_sites: ClassVar[tuple[str, ...]] = ("z", "mlp")
    # Edits applied in the family's own replay of the forward (run_capture), not by edit_hooks.
    replays_edits: ClassVar[bool] = False

    def check_edits(self, edits) -> None:
        """Raise :class:`core.errors.InterventionError` for an edit this family
        cannot apply (a site it does not have, a block out of range)."""
        n = len(self.blocks)
        for e in edits:
            if e.site not in self.edit_sites:
                raise InterventionError(
                    f"{self.family}: no {e.site!r} edit site (this family has: {', '.join(self.edit_sites)})"
                )
            if e.block is not None and not 0 <= e.block < n:
                raise InterventionError(f"{e.describe()}: block out of range (the model has {n} blocks)")

    def edit_hooks(self, edits) -> list:
        """``[(module, kind, fn)]`` applying :class:`core.forward.edits.Edit` s: a
        pre-hook on the output projection changes a head's ``z`` slice (so the
        head's write ``W_O^h z^h`` changes and ``b_O`` stays), a forward hook
        changes the MLP output, a pre-hook on a layer changes the residual
        entering it, hooks on :meth:`visual_site_module` change visual features,
        and a pre-hook on the attention module adds ``-inf`` to the knocked-out
        entries of the additive attention mask it is called with (so only the
        chosen block's softmax sees them, and its other weights renormalise;
        under sdpa's causal fast path, called with no mask, the causal mask is
        made explicit first)."""
        self.check_edits(edits)
        regs = []
        for e in edits:
            if e.site == "mlp":

                def mlp(module, args, out, e=e):
                    return e.apply(out)

                regs.append((self.mlp_module(e.block), "fwd", mlp))
            elif e.site == "z":

                def z(module, args, e=e):
                    return (e.apply(args[0], self.d_head), *args[1:])

                regs.append((self.z_module(e.block), "pre", z))
            elif e.site == "resid":

                def resid(module, args, kwargs, e=e):
                    if args:
                        return (e.apply(args[0]), *args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": e.apply(kwargs["hidden_states"])}

                regs.append((self.layer_module(e.block), "pre_kw", resid))
            elif e.site == "mixer":

                def mixer(module, args, out, e=e):
                    return (e.apply(out[0]), *out[1:]) if isinstance(out, tuple) else e.apply(out)

                regs.append((self.mixer_module(e.block), "fwd", mixer))
            elif e.site == "expert":
                regs.append((self.mlp_module(e.block), "fwd_kw", self._expert_hook(e)))
            elif e.site == "knockout":
                regs.append((self.attention_module(e.block), "pre_kw", self._knockout_hook(e)))
            else:  # visual feature sites
                module, kind = self.visual_site_module(e.site)
                if kind == "pre":

                    def pre(module, args, e=e):
                        return (e.apply(args[0]), *args[1:])

                    regs.append((module, "pre", pre))
                else:

                    def fwd(module, args, out, e=e):
                        return e.apply(out)

                    regs.append((module, "fwd", fwd))
        return regs

    def _expert_hook(self, e):
        """A forward hook on a mixture-of-experts MLP that takes expert ``e.expert``'s
        write (recomputed from the module's own input) out of its output, or replaces it."""
        if not 0 <= e.expert < self.moe_experts(e.block):
            raise InterventionError(f"{e.describe()}: block {e.block} has {self.moe_experts(e.block)} routed experts")

        def expert(module, args, kwargs, out, e=e):
            x = args[0] if args else kwargs["hidden_states"]
            rows = x.reshape(-1, x.shape[-1])
            ((_, part),) = self.expert_writes(e.block, rows, expert=e.expert)
            written = out[0] if isinstance(out, tuple) else out
            edited = e.apply_part(written, part.view(written.shape).to(written.dtype))
            return (edited, *out[1:]) if isinstance(out, tuple) else edited

        return expert

    def _knockout_hook(self, e):
        """A pre-hook (with kwargs) on an attention module that knocks edges out
        of the additive mask ``(batch, 1 | heads, q, k)`` it is called with."""

        def knock(module, args, kwargs):
            mask = kwargs.get("attention_mask")
            hidden = args[0] if args else kwargs["hidden_states"]
            if mask is None:  # sdpa's causal fast path: the causal mask it would apply, made explicit
                if not getattr(module, "is_causal", True) or kwargs.get("cross_attention_states") is not None:
                    raise InterventionError(
                        f"{self.family}: cannot knock out edges, the attention is called without a mask"
                    )
                n = hidden.shape[1]
                causal = torch.ones(n, n, dtype=torch.bool, device=hidden.device).tril()
                mask = causal.view(1, 1, n, n).expand(hidden.shape[0], 1, n, n)
            if mask.dtype == torch.bool:  # True = may attend; additive in the stream's dtype (sdpa takes no other)
                additive = torch.zeros(mask.shape, dtype=hidden.dtype, device=mask.device)
                mask = additive.masked_fill(~mask, float("-inf"))
            b, _, q, k = mask.shape
            mask = e.knock(mask.expand(b, self.n_heads, q, k))
            return args, {**kwargs, "attention_mask": mask}

        return knock

    def site_record_hooks(self, site: str, store: dict) -> list:
        """``[(module, kind, fn)]`` that store the visual-feature site's tensor
        ``(batch, n_visual, width)`` in ``store[site]`` (what the module computed,
        before any edit at that site)."""
        module, kind = self.visual_site_module(site)
        if kind == "pre":

            def pre(module, args):
                store[site] = args[0]

            return [(module, "pre", pre)]

        def fwd(module, args, out):
            store[site] = out

        return [(module, "fwd", fwd)]
