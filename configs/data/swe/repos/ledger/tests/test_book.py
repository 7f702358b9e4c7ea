from ledger.book import Book


def test_balance_sums_entries():
    book = Book()
    book.add("rent", "-500.00")
    book.add("pay", "1200.50")
    assert book.balance() == "700.50"


def test_largest_uses_absolute_amounts():
    book = Book()
    book.add("coffee", "3.20")
    book.add("rent", "-500.00")
    assert book.largest() == "rent"


def test_largest_of_empty_book():
    assert Book().largest() is None
