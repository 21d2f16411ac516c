"""Real-code tasks for real models, shipped as Python literals (no data files to lose):

* :func:`function_tasks` -- implement a function from its signature and docstring; the docstring
  examples are the visible cases, more cases are hidden;
* :func:`repo_tasks` -- a small package (several files) whose ``unittest`` suite fails; the
  answer gives the fixed files; hidden test files are scored too.

Every task carries a hand-written correct answer (``reference``) and :data:`BROKEN` holds
plausible wrong answers per task id; ``tests/test_envs.py`` checks that the references score 1.0
and the broken ones less. Answers use the formats :mod:`hetrl.envs.coding` parses.
"""

from __future__ import annotations

import textwrap
from typing import Any

from hetrl.envs.coding import FunctionCase, FunctionTask, RepoTask


def _d(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def _fence(code: str, path: str = "") -> str:
    return f"```python{' ' + path if path else ''}\n{_d(code)}```"


def _function_task(task_id: str, signature: str, doc: str, visible: list[tuple[tuple, Any]],
                   hidden: list[tuple[tuple, Any]], reference: str) -> FunctionTask:
    name = signature.split("(", 1)[0]
    examples = "\n".join(f"    >>> {name}({', '.join(map(repr, args))})\n    {expected!r}"
                         for args, expected in visible)
    doc_lines = "\n".join(("    " + line) if line else "" for line in _d(doc).rstrip().splitlines())
    prompt = (f"Implement this function. Reply with the complete function in a ```python block.\n\n"
              f"def {signature}:\n    \"\"\"\n{doc_lines}\n\n{examples}\n    \"\"\"\n")
    return FunctionTask(
        task_id=task_id, family="realcode-function", prompt=prompt, entry_point=name,
        visible=tuple(FunctionCase(args=a, expected=e) for a, e in visible),
        hidden=tuple(FunctionCase(args=a, expected=e) for a, e in hidden),
        reference=_fence(reference),
    )


def function_tasks() -> tuple[FunctionTask, ...]:
    """Function-from-docstring tasks."""
    return (
        _function_task(
            "fn-run-length-encode", "run_length_encode(s: str) -> str",
            """
            Encode every maximal run of one character as the character followed by the run length.
            """,
            visible=[(("aaabcc",), "a3b1c2"), (("",), "")],
            hidden=[(("aaabcc",), "a3b1c2"), (("",), ""), (("x",), "x1"), (("abab",), "a1b1a1b1"),
                    (("zzzzzzzzzzzz",), "z12"), (("aabbbaa",), "a2b3a2"), ((" ",), " 1")],
            reference='''
            def run_length_encode(s: str) -> str:
                out = []
                i = 0
                while i < len(s):
                    j = i
                    while j < len(s) and s[j] == s[i]:
                        j += 1
                    out.append(f"{s[i]}{j - i}")
                    i = j
                return "".join(out)
            ''',
        ),
        _function_task(
            "fn-merge-intervals", "merge_intervals(intervals: list[list[int]]) -> list[list[int]]",
            """
            Merge overlapping or touching closed intervals [start, end] and return them sorted by start.
            The input may be in any order.
            """,
            visible=[(([[1, 3], [2, 6], [8, 10]],), [[1, 6], [8, 10]]), (([[4, 5], [1, 4]],), [[1, 5]])],
            hidden=[(([],), []), (([[5, 7]],), [[5, 7]]), (([[8, 10], [1, 3], [2, 6]],), [[1, 6], [8, 10]]),
                    (([[1, 2], [3, 4]],), [[1, 2], [3, 4]]), (([[1, 10], [2, 3], [4, 5]],), [[1, 10]]),
                    (([[4, 5], [1, 4]],), [[1, 5]]), (([[0, 0], [0, 0]],), [[0, 0]]),
                    (([[6, 8], [1, 2], [2, 5], [9, 9]],), [[1, 5], [6, 8], [9, 9]])],
            reference='''
            def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:
                merged = []
                for start, end in sorted(intervals):
                    if merged and start <= merged[-1][1]:
                        merged[-1][1] = max(merged[-1][1], end)
                    else:
                        merged.append([start, end])
                return merged
            ''',
        ),
        _function_task(
            "fn-roman-to-int", "roman_to_int(s: str) -> int",
            """
            Convert a valid Roman numeral (I, V, X, L, C, D, M; subtractive pairs such as IV and CM)
            to an integer.
            """,
            visible=[(("XIV",), 14), (("MCMXCIV",), 1994)],
            hidden=[(("I",), 1), (("III",), 3), (("IV",), 4), (("IX",), 9), (("LVIII",), 58),
                    (("MCMXCIV",), 1994), (("MMMCMXCIX",), 3999), (("CDXLIV",), 444)],
            reference='''
            def roman_to_int(s: str) -> int:
                values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
                total = 0
                for i, ch in enumerate(s):
                    v = values[ch]
                    if i + 1 < len(s) and values[s[i + 1]] > v:
                        total -= v
                    else:
                        total += v
                return total
            ''',
        ),
        _function_task(
            "fn-is-balanced", "is_balanced(s: str) -> bool",
            """
            True when the brackets (), [] and {} in s are balanced and properly nested.
            Other characters are ignored.
            """,
            visible=[(("(a[b]{c})",), True), (("(]",), False)],
            hidden=[(("",), True), (("()[]{}",), True), (("([{}])",), True), (("(]",), False),
                    (("([)]",), False), (("((",), False), (("))",), False), (("x(y)z]",), False),
                    (("{[a](b)}c",), True)],
            reference='''
            def is_balanced(s: str) -> bool:
                pairs = {")": "(", "]": "[", "}": "{"}
                stack = []
                for ch in s:
                    if ch in "([{":
                        stack.append(ch)
                    elif ch in pairs:
                        if not stack or stack.pop() != pairs[ch]:
                            return False
                return not stack
            ''',
        ),
        _function_task(
            "fn-factorial", "factorial(n: int) -> int",
            """
            n! for n >= 0, exactly (Python ints have no size limit).
            """,
            visible=[((5,), 120), ((0,), 1)],
            hidden=[((1,), 1), ((10,), 3628800), ((20,), 2432902008176640000),
                    ((25,), 15511210043330985984000000)],
            reference='''
            def factorial(n: int) -> int:
                out = 1
                for k in range(2, n + 1):
                    out *= k
                return out
            ''',
        ),
        _function_task(
            "fn-min-max", "min_max(xs: list[int]) -> tuple[int, int]",
            """
            The smallest and the largest element of a non-empty list, as a tuple (smallest, largest).
            """,
            visible=[(([3, 1, 2],), (1, 3)), (([7],), (7, 7))],
            hidden=[(([-1, -5],), (-5, -1)), (([0, 0, 0],), (0, 0)), (([9, -9, 4, 2],), (-9, 9)),
                    (([3, 1, 2],), (1, 3))],
            reference='''
            def min_max(xs: list[int]) -> tuple[int, int]:
                return min(xs), max(xs)
            ''',
        ),
    )


_TEXTSTATS_FILES = {
    "textstats/__init__.py": _d('''
        from textstats.stats import mean_word_length, top_words
        from textstats.tokenize import words
        '''),
    "textstats/tokenize.py": _d('''
        def words(text):
            """Lower-cased words of text; punctuation .,;:!? is stripped from both ends of a word."""
            return text.split()
        '''),
    "textstats/stats.py": _d('''
        from collections import Counter

        from textstats.tokenize import words


        def mean_word_length(text):
            """Mean length of the words of text; 0.0 when there are none."""
            ws = words(text)
            return sum(len(w) for w in ws) / len(ws)


        def top_words(text, n):
            """The n most frequent words as (word, count), most frequent first, ties alphabetical."""
            counts = Counter(words(text))
            return counts.most_common(n)
        '''),
}
_TEXTSTATS_TESTS = {
    "tests/test_textstats.py": _d('''
        import unittest

        from textstats import mean_word_length, top_words, words


        class TestWords(unittest.TestCase):
            def test_lowercase(self):
                self.assertEqual(words("Hello World"), ["hello", "world"])

            def test_punctuation(self):
                self.assertEqual(words("Hi, there!"), ["hi", "there"])


        class TestStats(unittest.TestCase):
            def test_mean(self):
                self.assertEqual(mean_word_length("ab abcd"), 3.0)

            def test_mean_empty(self):
                self.assertEqual(mean_word_length(""), 0.0)

            def test_top_words_ties(self):
                self.assertEqual(top_words("b a b a c", 2), [("a", 2), ("b", 2)])
        '''),
}
_TEXTSTATS_HIDDEN = {
    "tests/test_textstats_hidden.py": _d('''
        import unittest

        from textstats import mean_word_length, top_words, words


        class TestHidden(unittest.TestCase):
            def test_only_punctuation(self):
                self.assertEqual(words("... !"), [])

            def test_mean_ignores_punctuation(self):
                self.assertEqual(mean_word_length("a, bb."), 1.5)

            def test_top_words_case(self):
                self.assertEqual(top_words("The the THE cat", 1), [("the", 3)])
        '''),
}
_TEXTSTATS_TOKENIZE_FIX = '''
    def words(text):
        """Lower-cased words of text; punctuation .,;:!? is stripped from both ends of a word."""
        out = []
        for w in text.lower().split():
            w = w.strip(".,;:!?")
            if w:
                out.append(w)
        return out
    '''
_TEXTSTATS_STATS_FIX = '''
    from collections import Counter

    from textstats.tokenize import words


    def mean_word_length(text):
        """Mean length of the words of text; 0.0 when there are none."""
        ws = words(text)
        return sum(len(w) for w in ws) / len(ws) if ws else 0.0


    def top_words(text, n):
        """The n most frequent words as (word, count), most frequent first, ties alphabetical."""
        counts = Counter(words(text))
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    '''

_INVENTORY_FILES = {
    "inventory/__init__.py": "",
    "inventory/store.py": _d('''
        class Inventory:
            """Item counts. remove() raises KeyError for unknown items and ValueError when there
            are not enough; counts never go negative and items at zero disappear."""

            def __init__(self):
                self.counts = {}

            def add(self, item, n=1):
                self.counts[item] = self.counts.get(item, 0) + n

            def remove(self, item, n=1):
                self.counts[item] = self.counts.get(item, 0) - n

            def total(self):
                return sum(self.counts.values())
        '''),
    "inventory/pricing.py": _d('''
        def price(unit_price, quantity, discount_percent=0):
            """Total price in cents, rounded half up, after a percentage discount."""
            gross = unit_price * quantity
            return round(gross - discount_percent)
        '''),
}
_INVENTORY_TESTS = {
    "tests/test_inventory.py": _d('''
        import unittest

        from inventory.pricing import price
        from inventory.store import Inventory


        class TestStore(unittest.TestCase):
            def test_add_remove(self):
                inv = Inventory()
                inv.add("apple", 3)
                inv.remove("apple", 2)
                self.assertEqual(inv.total(), 1)

            def test_remove_unknown(self):
                with self.assertRaises(KeyError):
                    Inventory().remove("pear")

            def test_remove_too_many(self):
                inv = Inventory()
                inv.add("apple", 1)
                with self.assertRaises(ValueError):
                    inv.remove("apple", 2)
                self.assertEqual(inv.counts, {"apple": 1})


        class TestPricing(unittest.TestCase):
            def test_no_discount(self):
                self.assertEqual(price(250, 4), 1000)

            def test_discount(self):
                self.assertEqual(price(1000, 2, 10), 1800)
        '''),
}
_INVENTORY_HIDDEN = {
    "tests/test_inventory_hidden.py": _d('''
        import unittest

        from inventory.pricing import price
        from inventory.store import Inventory


        class TestHidden(unittest.TestCase):
            def test_zero_disappears(self):
                inv = Inventory()
                inv.add("fig", 2)
                inv.remove("fig", 2)
                self.assertEqual(inv.counts, {})

            def test_round_half_up(self):
                self.assertEqual(price(5, 1, 50), 3)
        '''),
}
_INVENTORY_STORE_FIX = '''
    class Inventory:
        """Item counts. remove() raises KeyError for unknown items and ValueError when there
        are not enough; counts never go negative and items at zero disappear."""

        def __init__(self):
            self.counts = {}

        def add(self, item, n=1):
            self.counts[item] = self.counts.get(item, 0) + n

        def remove(self, item, n=1):
            if item not in self.counts:
                raise KeyError(item)
            if self.counts[item] < n:
                raise ValueError(f"only {self.counts[item]} {item} left")
            self.counts[item] -= n
            if self.counts[item] == 0:
                del self.counts[item]

        def total(self):
            return sum(self.counts.values())
    '''
_INVENTORY_PRICING_FIX = '''
    def price(unit_price, quantity, discount_percent=0):
        """Total price in cents, rounded half up, after a percentage discount."""
        cents = unit_price * quantity * (100 - discount_percent)
        return (cents + 50) // 100
    '''

_KVCONF_FILES = {
    "kvconf/__init__.py": "from kvconf.parser import Config, parse\n",
    "kvconf/parser.py": _d('''
        class Config(dict):
            def get_int(self, key, default=None):
                """The value of key as an int, default when the key is missing."""
                return int(self[key])


        def parse(text):
            """Parse "key = value" lines into a Config. Blank lines and lines starting with # are
            skipped; keys and values are stripped of surrounding spaces; later keys win."""
            config = Config()
            for line in text.splitlines():
                key, value = line.split("=", 1)
                config[key] = value
            return config
        '''),
}
_KVCONF_TESTS = {
    "tests/test_kvconf.py": _d('''
        import unittest

        from kvconf import parse


        class TestParse(unittest.TestCase):
            def test_strip(self):
                self.assertEqual(parse("a = 1\\nb=two"), {"a": "1", "b": "two"})

            def test_comments_and_blanks(self):
                self.assertEqual(parse("# c\\n\\nx = y\\n"), {"x": "y"})

            def test_get_int(self):
                config = parse("n = 42")
                self.assertEqual(config.get_int("n"), 42)
                self.assertEqual(config.get_int("m", 7), 7)
        '''),
}
_KVCONF_HIDDEN = {
    "tests/test_kvconf_hidden.py": _d('''
        import unittest

        from kvconf import parse


        class TestHidden(unittest.TestCase):
            def test_value_with_equals(self):
                self.assertEqual(parse("url = a=b"), {"url": "a=b"})

            def test_later_wins(self):
                self.assertEqual(parse("k = 1\\nk = 2").get_int("k"), 2)
        '''),
}
_KVCONF_FIX = '''
    class Config(dict):
        def get_int(self, key, default=None):
            """The value of key as an int, default when the key is missing."""
            return int(self[key]) if key in self else default


    def parse(text):
        """Parse "key = value" lines into a Config. Blank lines and lines starting with # are
        skipped; keys and values are stripped of surrounding spaces; later keys win."""
        config = Config()
        for line in text.splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            key, value = line.split("=", 1)
            config[key.strip()] = value.strip()
        return config
    '''
_KVCONF_PARTIAL = '''
    class Config(dict):
        def get_int(self, key, default=None):
            """The value of key as an int, default when the key is missing."""
            return int(self[key])


    def parse(text):
        """Parse "key = value" lines into a Config. Blank lines and lines starting with # are
        skipped; keys and values are stripped of surrounding spaces; later keys win."""
        config = Config()
        for line in text.splitlines():
            if line.strip():
                key, value = line.split("=", 1)
                config[key.strip()] = value.strip()
        return config
    '''


def repo_tasks() -> tuple[RepoTask, ...]:
    """Repository tasks: make the failing unittest suite pass."""
    return (
        RepoTask(
            task_id="repo-textstats", family="realcode-repo",
            issue="The textstats package fails its tests: words() must lower-case and strip punctuation, "
                  "mean_word_length() crashes on empty text, and top_words() does not order ties.",
            files=_TEXTSTATS_FILES, tests=_TEXTSTATS_TESTS, hidden_tests=_TEXTSTATS_HIDDEN,
            reference=_fence(_TEXTSTATS_TOKENIZE_FIX, "textstats/tokenize.py") + "\n\n"
                      + _fence(_TEXTSTATS_STATS_FIX, "textstats/stats.py"),
        ),
        RepoTask(
            task_id="repo-inventory", family="realcode-repo",
            issue="Inventory.remove() lets counts go negative and never raises; price() subtracts the "
                  "discount percentage as if it were cents.",
            files=_INVENTORY_FILES, tests=_INVENTORY_TESTS, hidden_tests=_INVENTORY_HIDDEN,
            reference=_fence(_INVENTORY_STORE_FIX, "inventory/store.py") + "\n\n"
                      + _fence(_INVENTORY_PRICING_FIX, "inventory/pricing.py"),
        ),
        RepoTask(
            task_id="repo-kvconf", family="realcode-repo",
            issue="kvconf.parse() crashes on comments and blank lines and keeps the spaces around keys "
                  "and values; Config.get_int() ignores its default.",
            files=_KVCONF_FILES, tests=_KVCONF_TESTS, hidden_tests=_KVCONF_HIDDEN,
            reference=_fence(_KVCONF_FIX, "kvconf/parser.py"),
        ),
    )


#: Wrong answers per task id (each scores below 1.0): off-by-one, a missed case, a partial fix.
BROKEN: dict[str, tuple[str, ...]] = {
    "fn-run-length-encode": (_fence('''
        def run_length_encode(s: str) -> str:
            out, count = [], 1
            for i in range(1, len(s)):
                if s[i] == s[i - 1]:
                    count += 1
                else:
                    out.append(f"{s[i - 1]}{count}")
                    count = 1
            return "".join(out)
        '''),),
    "fn-merge-intervals": (_fence('''
        def merge_intervals(intervals: list[list[int]]) -> list[list[int]]:
            merged = []
            for start, end in intervals:
                if merged and start < merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([start, end])
            return merged
        '''),),
    "fn-factorial": (_fence('''
        def factorial(n: int) -> int:
            out = 1
            for k in range(2, n):
                out *= k
            return out
        '''),),
    "fn-min-max": (_fence('''
        def min_max(xs: list[int]) -> tuple[int, int]:
            return [min(xs), max(xs)]
        '''),),
    "fn-roman-to-int": (_fence('''
        def roman_to_int(s: str) -> int:
            values = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
            return sum(values[ch] for ch in s)
        '''),),
    "fn-is-balanced": (_fence('''
        def is_balanced(s: str) -> bool:
            depth = 0
            for ch in s:
                if ch in "([{":
                    depth += 1
                elif ch in ")]}":
                    depth -= 1
                if depth < 0:
                    return False
            return depth == 0
        '''),),
    "repo-textstats": (
        _fence(_TEXTSTATS_TOKENIZE_FIX, "textstats/tokenize.py"),
        _fence(_TEXTSTATS_STATS_FIX, "textstats/stats.py"),
    ),
    "repo-inventory": (
        _fence(_INVENTORY_STORE_FIX, "inventory/store.py"),
        _fence(_INVENTORY_PRICING_FIX, "inventory/pricing.py"),
    ),
    "repo-kvconf": (
        _fence(_KVCONF_PARTIAL, "kvconf/parser.py"),
        # the right fix delivered without a file path: nothing can be applied
        _fence(_KVCONF_FIX),
    ),
}
