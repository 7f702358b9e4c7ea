from ledger.money import format_cents, parse_cents


class Book:
    def __init__(self):
        self.entries = []

    def add(self, label, amount):
        self.entries.append((label, parse_cents(amount)))

    def balance(self):
        return format_cents(sum(cents for _, cents in self.entries))

    def largest(self):
        """Label of the entry with the largest absolute amount (the first one on ties)."""
        best = None
        for label, cents in self.entries:
            if best is None or cents > best[1]:
                best = (label, cents)
        return best[0] if best else None
