"""The markdown tables `nq bench` prints (llama-bench's look), for bench.py and gemm_table.py."""
from __future__ import annotations


def md_table(header: list, rows: list, right: set) -> str:
    """A padded markdown table; columns whose index is in `right` are right-aligned."""
    w = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    w = [max(3, x) for x in w]

    def line(cells):
        return "| " + " | ".join(str(c).rjust(w[i]) if i in right else str(c).ljust(w[i])
                                 for i, c in enumerate(cells)) + " |"
    sep = "| " + " | ".join(("-" * (w[i] - 1) + ":") if i in right else "-" * w[i]
                            for i in range(len(w))) + " |"
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def cell(v, fmt: str) -> str:
    """v formatted, or "-" for a figure that was not measured."""
    return "-" if v is None else format(v, fmt)
