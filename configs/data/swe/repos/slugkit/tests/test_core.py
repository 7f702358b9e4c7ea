from slugkit import slugify


def test_plain_words():
    assert slugify("hello world") == "hello-world"


def test_custom_separator():
    assert slugify("a b c", separator="_") == "a_b_c"


def test_mixed_case_is_lowered():
    assert slugify("Hello World") == "hello-world"


def test_punctuation_runs_collapse():
    assert slugify("Ready, Set... Go!") == "ready-set-go"
