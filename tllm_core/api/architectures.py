"""Where a model family's decoder layers and tap sites are (docs/architectures.md)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import MappingProxyType

# Per-step sites (``TapRequest`` with no layer), read from the runner after the forward.
STEP_SITES = ("final", "logits", "sampled")

# How a site's module output holds its tensor (a bare tensor is the value in each form):
OUTPUTS = MappingProxyType(
    {
        "tensor": "the output is the tensor",
        "sum": "(hidden, residual): the value is hidden + residual (Llama-style decoder layer)",
        "first": "a tuple: the value is its first element (e.g. vLLM's fused add-norm's output)",
        "router": "an MoE block (``experts`` beside a router gate): the value is the gate's "
        "output, the router logits [tokens, experts] before softmax and top-k",
    }
)


def identifier(value: object, what: str) -> str:
    """``value`` if it is a Python identifier, else a ``ValueError`` naming ``what``."""
    if not (isinstance(value, str) and value.isidentifier()):
        raise ValueError(f"{what} must be a Python identifier, got {value!r}")
    return value


@dataclass(frozen=True)
class SiteSpec:
    """A tap site in a decoder layer: a module whose output carries one tensor (docs/ports.md)."""

    name: str
    # Child attributes of the layer that may hold the module, tried in order; empty: the layer.
    children: tuple[str, ...] = ()
    output: str = "tensor"  # a key of OUTPUTS
    what: str = ""  # for errors: "self-attention block"
    # Siblings whose output the layer adds to the site's inline: the site is refused there.
    partial_if: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        identifier(self.name, "a site's name")
        if self.name in STEP_SITES:
            raise ValueError(f"site name {self.name!r} is taken by a per-step site {STEP_SITES}")
        if self.output not in OUTPUTS:
            raise ValueError(
                f"site {self.name!r}: output {self.output!r} is not one of {', '.join(OUTPUTS)}"
            )
        for c in (*self.children, *self.partial_if):
            identifier(c, f"site {self.name!r}: a child module name")

    @property
    def label(self) -> str:
        return self.what or (f"{'/'.join(self.children)} module" if self.children else "layer")


@dataclass(frozen=True)
class ArchitectureSpec:
    """A family of decoder layers: where the layer list is and how its sites differ."""

    name: str
    # Decoder layer class names (``type(layer).__name__``); empty: the one default family.
    layer_classes: frozenset[str] = frozenset()
    # Dotted path to the decoder layers' ``ModuleList``; None or absent: found by shape.
    layers: str | None = None
    sites: tuple[SiteSpec, ...] = ()

    def __post_init__(self) -> None:
        if not (isinstance(self.name, str) and self.name):
            raise ValueError(f"an architecture needs a name, got {self.name!r}")
        object.__setattr__(self, "layer_classes", frozenset(self.layer_classes))
        if self.layers is not None:
            for part in self.layers.split("."):
                identifier(part, f"architecture {self.name!r}: a part of its layers path")
        names = [s.name for s in self.sites]
        if len(set(names)) != len(names):
            raise ValueError(f"architecture {self.name!r} names a site twice: {names}")


class Architectures:
    """Every registered spec, merged; ``ValueError`` naming both when two claim one thing."""

    def __init__(self, specs: Iterable[ArchitectureSpec | SiteSpec] = ()):
        self.default: ArchitectureSpec | None = None
        self.families: list[ArchitectureSpec] = []
        self.sites: dict[str, SiteSpec] = {}  # general sites, by name
        self._site_owner: dict[str, str] = {}
        self._by_class: dict[str, ArchitectureSpec] = {}
        for spec in specs:
            self.add(spec)

    def add(self, spec: ArchitectureSpec | SiteSpec, owner: str = "?") -> None:
        if isinstance(spec, SiteSpec):
            self._add_site(spec, owner)
        elif not isinstance(spec, ArchitectureSpec):
            raise TypeError(f"expected an ArchitectureSpec or SiteSpec, got {spec!r}")
        elif not spec.layer_classes:
            if self.default is not None:
                raise ValueError(
                    f"two default architectures (no layer_classes): {self.default.name!r} "
                    f"and {spec.name!r}; give the new one layer_classes"
                )
            self.default = spec
            for s in spec.sites:
                self._add_site(s, f"architecture {spec.name!r}")
        else:
            for cls in sorted(spec.layer_classes):
                old = self._by_class.get(cls)
                if old is not None:
                    raise ValueError(
                        f"layer class {cls!r} is described twice: by {old.name!r} and {spec.name!r}"
                    )
            self.families.append(spec)
            self._by_class.update(dict.fromkeys(spec.layer_classes, spec))

    def _add_site(self, site: SiteSpec, owner: str) -> None:
        if site.name in self.sites:
            raise ValueError(
                f"site {site.name!r} is defined twice: by {self._site_owner[site.name]} and "
                f"{owner}; a family's own variant goes in its ArchitectureSpec.sites"
            )
        self.sites[site.name] = site
        self._site_owner[site.name] = owner

    def names(self) -> list[str]:
        """Every layer site name (general and family-only), sorted."""
        fam = {s.name for f in self.families for s in f.sites}
        return sorted(set(self.sites) | fam)

    def site(self, name: str, layer_class: str) -> SiteSpec | None:
        """Site ``name`` at a ``layer_class`` layer (its family's variant first), or None."""
        family = self._by_class.get(layer_class)
        for s in family.sites if family is not None else ():
            if s.name == name:
                return s
        return self.sites.get(name)

    def layer_paths(self) -> list[tuple[ArchitectureSpec, str]]:
        """``(spec, layers path)`` to try, families before the default."""
        specs = [*self.families, *([self.default] if self.default else [])]
        return [(s, s.layers) for s in specs if s.layers]

    def check_site(self, site: str) -> None:
        """Raise ``ValueError`` naming ``site`` and the known sites when none is ``site``."""
        if site not in STEP_SITES and site not in self.names():
            known = ", ".join([*self.names(), *STEP_SITES])
            raise ValueError(
                f"unknown tap site {site!r}; the registered sites are {known} (a plugin adds "
                f"one through the tllm_architectures hook)"
            )
