"""The package's import graph by stage: `docs/import-graph.png`.

The stages and their order are the ones `tests/package/test_layers.py` enforces (its `PIPELINE`), and the
graph is that test's (every import, lazy ones included), so the drawing shows what is checked:
one box per stage, lowest at the bottom, an arrow from each stage to every stage it imports,
and the cross-cutting root modules beside them. An arrow that points up would be drawn red; the
test fails before that can happen.

    python3 docs/tables/import_graph.py [--out docs/import-graph.png]
"""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layers():
    spec = importlib.util.spec_from_file_location("test_layers", ROOT / "tests" / "test_layers.py")
    layers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layers)
    return layers


def stage_edges(graph: dict[str, set[str]], pipeline: tuple[str, ...]) -> dict[tuple[int, int], int]:
    """(importer's stage, imported stage) -> how many module imports cross between them."""
    def stage(m: str) -> int | None:
        return next((i for i, p in enumerate(pipeline) if m == p or m.startswith(p + ".")), None)

    edges: dict[tuple[int, int], int] = {}
    for m, deps in graph.items():
        for d in deps:
            a, b = stage(m), stage(d)
            if a is not None and b is not None and a != b:
                edges[(a, b)] = edges.get((a, b), 0) + 1
    return edges


def draw(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    layers = _layers()
    graph, pipeline = layers.import_graph(), layers.PIPELINE
    edges = stage_edges(graph, pipeline)
    modules = {i: sum(1 for m in graph if m == p or m.startswith(p + ".")) for i, p in enumerate(pipeline)}
    fig, ax = plt.subplots(figsize=(9, 10))
    y = {i: i * 1.0 for i in range(len(pipeline))}
    for i, p in enumerate(pipeline):
        ax.add_patch(FancyBboxPatch((-1.1, y[i] - 0.3), 2.2, 0.6, boxstyle="round,pad=0.02", fc="#e8eef7", ec="#3b5b8c"))
        ax.text(0, y[i], f"{p.removeprefix('sparsecache.')}/  ({modules[i]} modules)", ha="center", va="center",
                fontsize=10)
    for n, ((a, b), count) in enumerate(sorted(edges.items(), key=lambda e: (e[0][0] - e[0][1], e[0]))):
        side = 1 if n % 2 else -1
        up = b > a
        arrow = FancyArrowPatch((side * 1.1, y[a]), (side * 1.1, y[b]), connectionstyle=f"arc3,rad={side * -0.25}",
                                arrowstyle="-|>", mutation_scale=10, lw=0.4 + 0.15 * min(count, 10),
                                color="red" if up else "#6b7a90", alpha=0.8)
        ax.add_patch(arrow)
    root = sorted(m.removeprefix("sparsecache.") for m in layers.ROOT_MODULES if m != "sparsecache")
    ax.text(3.4, len(pipeline) / 2 - 0.5, "at the root, used by every stage:\n\n" + "\n".join(f"{m}.py" for m in root),
            ha="center", va="center", fontsize=9, bbox=dict(boxstyle="round", fc="#f3f3f3", ec="#999999"))
    ax.set_xlim(-4.2, 4.6)
    ax.set_ylim(-0.8, len(pipeline) - 0.2)
    ax.axis("off")
    upward = sum(1 for a, b in edges if b > a)
    ax.set_title(f"sparsecache's imports by stage: {sum(edges.values())} cross-stage imports, {upward} upward\n"
                 "(an arrow goes from a stage to one it imports; lowest stage at the bottom)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"{out}: {len(pipeline)} stages, {sum(edges.values())} cross-stage imports, {upward} upward")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "import-graph.png")
    draw(parser.parse_args().out)
