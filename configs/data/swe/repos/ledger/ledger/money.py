def parse_cents(text):
    """'12.34' -> 1234; '7' -> 700; '-0.5' -> -50."""
    negative = text.startswith("-")
    whole, _, fraction = text.lstrip("-").partition(".")
    cents = int(whole or "0") * 100 + int((fraction + "00")[:2])
    return -cents if negative else cents


def format_cents(cents):
    """1234 -> '12.34'; -50 -> '-0.50'."""
    sign = "-" if cents < 0 else ""
    whole, rest = divmod(abs(cents), 100)
    return f"{sign}{whole}.{rest:02d}"
