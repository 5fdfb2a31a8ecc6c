"""Calendar dates named in a task's question, and whether they are all already past.

A task that asks about "the NBA games played on December 25, 2023" cannot be done as asked once that day is
gone; :func:`check_dates` finds such questions so that data preparation can list them (and drop them on request).
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass

_MONTHS = {
    "January": 1, "Jan": 1, "February": 2, "Feb": 2, "March": 3, "Mar": 3, "April": 4, "Apr": 4, "May": 5,
    "June": 6, "Jun": 6, "July": 7, "Jul": 7, "August": 8, "Aug": 8, "September": 9, "Sept": 9, "Sep": 9,
    "October": 10, "Oct": 10, "November": 11, "Nov": 11, "December": 12, "Dec": 12,
}  # fmt: skip
# Capitalised month names only, and a day number next to them: "may" the verb and "March 2024" are not dates.
_MONTH = r"(?:{})\b\.?".format("|".join(sorted(_MONTHS, key=len, reverse=True)))
_DAY = r"(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?(?![\d:])"
_YEAR = r"(?:19|20)\d\d(?!\d)"
_RANGE = r"\s*(?:-|–|—|to|through|until|till)\s*"
_DATE_PATTERN = re.compile(
    rf"\b(?P<m1>{_MONTH})\s+(?P<d1>{_DAY})(?:{_RANGE}(?:(?P<m1e>{_MONTH})\s+)?(?P<d1e>{_DAY}))?(?:,?\s+(?P<y1>{_YEAR}))?"
    rf"|\b(?P<d2>{_DAY})(?:\s*[-–—]\s*(?P<d2e>{_DAY}))?\s+(?:of\s+)?(?P<m2>{_MONTH})(?:,?\s+(?P<y2>{_YEAR}))?"
    r"|\b(?P<iy>(?:19|20)\d\d)-(?P<im>0?[1-9]|1[0-2])-(?P<id>[0-3]?\d)(?!\d)"
    r"|\b(?P<sa>[0-3]?\d)/(?P<sb>[0-3]?\d)/(?P<sy>(?:19|20)\d\d)(?!\d)"
)
# Text between two dates that makes them one span, so a year written once applies to both ends.
_CONNECTOR = re.compile(r"\s*,?\s*(?:-|–|—|to|through|until|till|and)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class NamedDate:
    """A calendar date named in a text. ``year`` is None when the text gives none and no neighbour lends one."""

    text: str
    start: int
    end: int
    month: int
    day: int
    year: int | None

    @property
    def date(self) -> dt.date | None:
        return dt.date(self.year, self.month, self.day) if self.year is not None else None


def _month_number(token: str) -> int:
    return _MONTHS[token.rstrip(".").strip()]


def _day_number(token: str) -> int:
    return int(re.match(r"\d+", token).group())


def _valid(month: int, day: int, year: int | None) -> bool:
    try:
        dt.date(2000 if year is None else year, month, day)  # 2000 is a leap year: "February 29" stays valid
    except ValueError:
        return False
    return True


def _dates_of_match(match: re.Match[str]) -> list[NamedDate]:
    """One regex match -> one or two dates (a range names both ends)."""
    text, start, end = match.group(), match.start(), match.end()
    g = match.groupdict()
    if g["sy"] is not None:
        a, b, year = int(g["sa"]), int(g["sb"]), int(g["sy"])
        readings = [(b, a)] if a > 12 else [(a, b)] if b > 12 else [(a, b), (b, a)]
        dates = [dt.date(year, m, d) for m, d in readings if _valid(m, d, year)]
        if not dates:
            return []
        latest = max(dates)  # day/month order unknown: judge by the later reading, never by a guess
        return [NamedDate(text, start, end, latest.month, latest.day, year)]
    if g["iy"] is not None:
        year, month, day = int(g["iy"]), int(g["im"]), int(g["id"])
        return [NamedDate(text, start, end, month, day, year)] if _valid(month, day, year) else []
    if g["m1"] is not None:
        month, day, year = _month_number(g["m1"]), _day_number(g["d1"]), g["y1"]
        end_month = _month_number(g["m1e"]) if g["m1e"] else month
        end_day = _day_number(g["d1e"]) if g["d1e"] else None
        if end_day is not None and g["m1e"] is None and end_day <= day:
            end_day = None  # "Jan 22 to 5 people" is not a range
    else:
        month, day, year = _month_number(g["m2"]), _day_number(g["d2"]), g["y2"]
        end_month, end_day = month, (_day_number(g["d2e"]) if g["d2e"] else None)
        if end_day is not None and end_day <= day:
            end_day = None
    year = int(year) if year else None
    if end_day is None:
        return [NamedDate(text, start, end, month, day, year)] if _valid(month, day, year) else []
    # "February 28 to March 2, 2024": the year belongs to the end; the start is in the year before if it wraps.
    start_year = None if year is None else year - 1 if (month, day) > (end_month, end_day) else year
    found = []
    if _valid(month, day, start_year):
        found.append(NamedDate(text, start, end, month, day, start_year))
    if _valid(end_month, end_day, year):
        found.append(NamedDate(text, start, end, end_month, end_day, year))
    return found


def find_named_dates(text: str) -> list[NamedDate]:
    """Calendar dates named in ``text``, in order.

    Recognised: "January 20, 2024", "Jan. 20th", "20 January 2024", "1st Jan", ranges such as "March 20-27, 2024",
    "February 28 to March 2, 2024", "Jan 22 to 25", "6-8 March 2024", ISO "2024-01-20" and "20/12/2023" (when the
    day/month order is ambiguous, the later reading). A date without a year borrows one from a dated neighbour it
    is joined to ("6 March to 8 March 2024"); otherwise its year stays unknown. Month-only ("March 2024") and
    year-only ("in 2023", "2023-24") mentions are not dates.
    """
    dates = [found for match in _DATE_PATTERN.finditer(text) for found in _dates_of_match(match)]

    def joined(left: NamedDate, right: NamedDate) -> bool:
        return left.end <= right.start and _CONNECTOR.fullmatch(text[left.end : right.start]) is not None

    for i in reversed(range(len(dates) - 1)):  # borrow from the right first: "6 March to 8 March 2024"
        here, after = dates[i], dates[i + 1]
        if here.year is None and after.year is not None and joined(here, after):
            year = after.year - 1 if (here.month, here.day) > (after.month, after.day) else after.year
            if _valid(here.month, here.day, year):
                dates[i] = NamedDate(here.text, here.start, here.end, here.month, here.day, year)
    for i in range(1, len(dates)):  # then from the left: "from Jan 1, 2024 to Jan 4"
        before, here = dates[i - 1], dates[i]
        if here.year is None and before.year is not None and joined(before, here):
            year = before.year + 1 if (here.month, here.day) < (before.month, before.day) else before.year
            if _valid(here.month, here.day, year):
                dates[i] = NamedDate(here.text, here.start, here.end, here.month, here.day, year)
    return dates


@dataclass(frozen=True)
class DateCheck:
    dates: list[NamedDate]
    past: bool  # every mention has a year, and the latest is before today
    undated: bool  # it names dates, none with a year

    @property
    def latest(self) -> dt.date | None:
        dated = [named.date for named in self.dates if named.date is not None]
        return max(dated) if dated else None


def check_dates(text: str, today: dt.date) -> DateCheck:
    """Whether ``text`` names only dates already past. Conservative: the latest date decides, so "between
    February 12, 2024 and August 9, 2050" is not past, and a date without a year (whose next occurrence is always
    ahead) keeps the whole text from being past."""
    dates = find_named_dates(text)
    latest = DateCheck(dates=dates, past=False, undated=False).latest
    all_dated = all(named.year is not None for named in dates)
    return DateCheck(
        dates=dates, past=latest is not None and all_dated and latest < today, undated=bool(dates) and latest is None
    )
