"""How a variable's text becomes its setting's value: each parser takes (the variable's name, its text)
and returns the typed value, or raises ``LaunchError`` in one line naming the variable, its value and
what was expected. ``run_config.py`` names each field's parser beside its variable."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

Parser = Callable[[str, str], Any]
_NUMBER = re.compile(r"([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]+)?")


class LaunchError(ValueError):
    """A setting that cannot run: printed as one line naming it, exit status 2."""


class Written(float):
    """A number that prints as the user wrote it (``2e-3`` stays ``2e-3`` in the command and its
    messages) and computes as the float it is."""

    text: str

    def __new__(cls, text: str) -> Written:
        number = super().__new__(cls, text)
        number.text = text
        return number

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return self.text


def positive(name: str, text: str) -> int:
    if not re.fullmatch(r"[1-9][0-9]*", text):
        raise LaunchError(f"{name}={text} must be a positive integer")
    return int(text)


def non_negative(name: str, text: str) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]*", text):
        raise LaunchError(f"{name}={text} must be a non-negative integer")
    return int(text)


def count(what: str) -> Parser:
    def parse(name: str, text: str) -> int:
        if not re.fullmatch(r"[0-9]+", text):
            raise LaunchError(f"{name}={text} must be a number of {what}")
        return int(text)

    return parse


def lora_rank(name: str, text: str) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]*", text):
        raise LaunchError(f"{name}={text} must be 0 (off) or a positive rank")
    return int(text)


def switch(meaning: str = "") -> Callable[[str, str], bool]:
    def parse(name: str, text: str) -> bool:
        if text not in ("0", "1"):
            raise LaunchError(f"{name}={text}: expected 0 or 1{meaning}")
        return text == "1"

    return parse


def one_of(*choices: str, message: str = "") -> Callable[[str, str], str]:
    def parse(name: str, text: str) -> str:
        if text not in choices:
            raise LaunchError(f"{name}={text}{message or ': expected ' + ' or '.join(choices)}")
        return text

    return parse


def packed(name: str, text: str) -> bool:
    return one_of("0", "1", message=": expected 0 (padded BSHD) or 1 (THD packing)")(name, text) == "1"


def learning_rate(name: str, text: str) -> Written:
    if not _NUMBER.fullmatch(text):
        raise LaunchError(f"{name}={text}: expected a number such as 1e-4")
    # the pattern admits 1e999, which is inf in fp32 and in Python alike: the first step would turn every weight NaN
    if not 0 <= float(text) < 1e38:
        raise LaunchError(f"{name}={text}: expected a finite learning rate")
    return Written(text)


def fraction(name: str, text: str) -> Written:
    if not re.fullmatch(r"0?\.[0-9]+|0", text):
        raise LaunchError(f"{name}={text}: expected a fraction below 1, such as 0.02")
    return Written(text)


def positive_number(example: str) -> Callable[[str, str], Written]:
    return _number_from(example, zero=False)


def non_negative_number(example: str) -> Callable[[str, str], Written]:
    return _number_from(example, zero=True)


def _number_from(example: str, zero: bool) -> Callable[[str, str], Written]:
    """A finite number above 0 (``zero``: or 0), as written."""

    def parse(name: str, text: str) -> Written:
        if not (_NUMBER.fullmatch(text) and (0 <= float(text) if zero else 0 < float(text)) and float(text) < 1e38):
            raise LaunchError(f"{name}={text}: expected {'0 or ' if zero else ''}a positive number such as {example}")
        return Written(text)

    return parse


def text(name: str, value: str) -> str:
    return value


def names(name: str, value: str) -> tuple[str, ...]:
    """A list of names, split at commas or spaces."""
    return tuple(part for part in re.split(r"[,\s]+", value) if part)
