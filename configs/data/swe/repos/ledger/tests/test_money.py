from ledger.money import format_cents, parse_cents


def test_parse_and_format_round_trip():
    for text in ("12.34", "0.05", "-3.10"):
        assert format_cents(parse_cents(text)) == text


def test_parse_whole_amounts():
    assert parse_cents("7") == 700
