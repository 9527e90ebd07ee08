"""Writes tests/data/sentences.txt: 2,000 verses of the King James Bible (1611, public domain), every 15th verse
from Genesis to Revelation, one per line: real English sentences of mixed length (2 to 90 words) for the embedding
tests and benchmark. The text comes from Debian's bible-kjv-text package, read with its `bible` program:

    apt-get download bible-kjv bible-kjv-text && for d in bible-kjv*.deb; do dpkg-deb -x "$d" kjv; done
    python tests/data/make_sentences.py kjv
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).with_name("sentences.txt")
EVERY = 15
COUNT = 2000
_VERSE = re.compile(r"^  \d+ (.+)$")  # "  12 And God said, ..." (book and chapter headers have no indent)


def verses(root: Path) -> list[str]:
    """Every verse of the KJV in order, as `bible` prints them one per line."""
    text = subprocess.run(
        [str(root / "usr/bin/bible"), "-l10000", "-p", str(root / "usr/lib"), "-d", "bible.data", "gen1:1-rev22:21"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [m.group(1).strip() for line in text.splitlines() if (m := _VERSE.match(line))]


def main(argv: list[str]) -> int:
    picked = verses(Path(argv[1]))[::EVERY][:COUNT]
    if len(picked) != COUNT:
        raise SystemExit(f"expected {COUNT} verses, got {len(picked)}")
    OUT.write_text("".join(f"{v}\n" for v in picked), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv))
