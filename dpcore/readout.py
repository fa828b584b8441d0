"""How privacy figures are shown to people: ε rounded up, never below the ledger's value.
Standard library only, so that commands can import it before torch.
"""

from __future__ import annotations


def epsilon_text(epsilon: float, spec: str = ".6g") -> str:
    """ε for a person to read: rounded *up* to the precision of ``spec`` (``".2f"``: decimals,
    ``".6g"``: significant digits), so that what is shown is never below the ledger's ε
    (``f"{1.00499:.2f}"`` reads 1.00; this reads 1.01)."""
    from decimal import ROUND_CEILING, Decimal

    value = float(epsilon)
    if not (value == value and abs(value) != float("inf")):
        return format(value, spec)
    kind, places = spec[-1], int(spec.lstrip(".")[:-1])
    exact = Decimal(repr(value))  # the shortest decimal that is this float (not its binary tail)
    if kind == "f":
        return str(exact.quantize(Decimal(1).scaleb(-places), rounding=ROUND_CEILING))
    if kind == "g" and value != 0:
        up = exact.quantize(Decimal(1).scaleb(exact.adjusted() - places + 1), rounding=ROUND_CEILING)
        return format(float(up), spec)  # the float nearest a ≤ places-digit decimal prints as that decimal
    return format(value, spec)
