"""How privacy figures are shown to people: ε rounded up, never below the ledger's value.
Standard library only, so that commands can import it before torch.
"""

from __future__ import annotations


def epsilon_text(epsilon: float, spec: str = ".6g") -> str:
    """ε for a person to read: rounded *up* to the precision of ``spec`` (``".2f"``: decimals,
    ``".6g"``: significant digits), so that what is shown is never below the ledger's ε
    (``f"{1.00499:.2f}"`` reads 1.00; this reads 1.01)."""
    import re
    from decimal import ROUND_CEILING, Decimal, localcontext

    value = float(epsilon)
    form = re.fullmatch(r"\.(\d+)([fg])", spec)
    if form is None or not (value == value and abs(value) != float("inf")):
        return format(value, spec)  # a spec it does not round (or inf, nan): as format() gives it
    places, kind = int(form.group(1)), form.group(2)
    exact = Decimal(repr(value))  # the shortest decimal that is this float (not its binary tail)
    with localcontext() as ctx:
        ctx.prec = max(28, exact.adjusted() + places + 5)  # room for every digit kept, however large ε is
        if kind == "f":
            return str(exact.quantize(Decimal(1).scaleb(-places), rounding=ROUND_CEILING))
        if value == 0:
            return format(value, spec)
        up = exact.quantize(Decimal(1).scaleb(exact.adjusted() - places + 1), rounding=ROUND_CEILING)
        return format(float(up), spec)  # the float nearest a ≤ places-digit decimal prints as that decimal
