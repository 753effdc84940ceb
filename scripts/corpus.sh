#!/usr/bin/env bash
# corpus.sh - build a plain-text English corpus of at least 50 MB from Debian packages and prepare it
# into byte shards with `fp8moe prep` (issue 22: a corpus large enough that a comparison run of a few
# thousand steps does not read its data more than twice, unlike the 1 MB tinyshakespeare).
#
#   bash scripts/corpus.sh [--out DIR] [--bin FP8MOE]
#
# Sources: the HTML documentation of the Linux kernel (Debian's `linux-doc`, e.g. linux-doc-6.1 on
# Debian 12: the kernel's RST guides and the API text kernel-doc extracts from the source) and of
# Python (`python3-doc`), the kernel's plain-text files that are not part of that HTML
# (Documentation/**/*.txt.gz) and Perl's manual (`perl-doc`, POD turned into text by pod2text). Each
# HTML page's main text (Sphinx's <div role="main">, without navigation, scripts and index pages) is
# turned into plain text with Python's standard html.parser; documents are put in an order fixed by a
# hash of their path, so the validation split (the last 10% of the bytes) is a
# mix of both sources rather than the tail of one. Writes DIR/corpus.txt, DIR/SOURCES.txt (packages and
# versions) and DIR/shards/ (`data.shards = DIR/shards` trains on it). DIR defaults to
# data/prepared/debian-docs (git-ignored). As root the missing packages are installed with apt-get;
# otherwise the script says what to install and exits 1. Same packages, same corpus, byte for byte.
set -euo pipefail

OUT=data/prepared/debian-docs
BIN=build/fp8moe
MIN_BYTES=$((50 * 1000 * 1000))
while [ $# -gt 0 ]; do
  case "$1" in
    --out) [ $# -ge 2 ] || { echo "corpus.sh: --out needs a directory" >&2; exit 2; }; OUT=$2; shift 2 ;;
    --bin) [ $# -ge 2 ] || { echo "corpus.sh: --bin needs the fp8moe binary" >&2; exit 2; }; BIN=$2; shift 2 ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "corpus.sh: unknown argument '$1'; expected --out DIR, --bin FP8MOE or --help" >&2; exit 2 ;;
  esac
done
[ -x "$BIN" ] || { echo "corpus.sh: $BIN is not an executable fp8moe (build it with make, or pass --bin)" >&2; exit 1; }

# linux-doc and python3-doc are Debian's meta-packages for the current versions (linux-doc-6.1 and
# python3.11-doc on Debian 12); python3 runs the HTML-to-text step, perl's pod2text the POD one.
PACKAGES=(linux-doc python3-doc perl-doc python3 perl)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg -s "$p" 2>/dev/null | grep '^Status: install ok installed$' >/dev/null || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    echo "corpus.sh: installing ${missing[*]}"
    apt-get install -y --no-install-recommends "${missing[@]}"
  else
    echo "corpus.sh: missing Debian packages: ${missing[*]}; run as root:" >&2
    echo "  apt-get install -y --no-install-recommends ${missing[*]}" >&2
    exit 1
  fi
fi
shopt -s nullglob
ROOTS=(/usr/share/doc/linux-doc-*/html /usr/share/doc/python3.*/html)
[ ${#ROOTS[@]} -ge 2 ] || { echo "corpus.sh: expected the HTML of linux-doc-* and python3.*-doc under /usr/share/doc; found: ${ROOTS[*]:-none}" >&2; exit 1; }

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the kernel loop below writes into $PLAIN from inside another directory
PLAIN="$OUT/plain.tmp"  # the plain-text documents: kernel .txt files and Perl's POD as text
rm -rf "$PLAIN"; mkdir -p "$PLAIN/kernel" "$PLAIN/perl"
trap 'rm -rf "$PLAIN" "$OUT/corpus.txt.tmp"' EXIT
for d in /usr/share/doc/linux-doc-*/Documentation; do
  (cd "$d" && find . -name '*.txt.gz' -print0 | sort -z | while IFS= read -r -d '' f; do
     g=${f#./}; mkdir -p "$PLAIN/kernel/$(dirname "$g")"; zcat "$f" > "$PLAIN/kernel/${g%.gz}"; done)
done
dpkg -L perl-doc | grep '\.pod$' | sort | while read -r f; do
  pod2text "$f" > "$PLAIN/perl/$(basename "$f" .pod).txt" 2>/dev/null || true
done
python3 - "$OUT/corpus.txt.tmp" "$PLAIN" "${ROOTS[@]}" <<'PY'
import hashlib, html.parser, os, re, sys

SKIP_PAGES = re.compile(r'(^|/)(genindex[^/]*|py-modindex|search|modindex|_sources|_static|_images|_downloads)(\.html|/)')

class MainText(html.parser.HTMLParser):
    """Text inside Sphinx's main <div role="main"> (or class "body"), minus scripts and header links."""
    BLOCK = {'p', 'div', 'section', 'li', 'dt', 'dd', 'tr', 'pre', 'h1', 'h2', 'h3', 'h4', 'h5', 'h6',
             'table', 'ul', 'ol', 'dl', 'blockquote', 'br', 'hr'}
    VOID = {'br', 'hr', 'img', 'meta', 'link', 'input', 'col', 'area', 'base', 'wbr', 'source'}
    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.depth = 0        # open tags inside the main div (0 = outside)
        self.skip_at = 0      # depth of the <script>, <style> or header link being skipped (0 = none)
        self.pre = 0
        self.out = []
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if self.depth == 0:
            if tag == 'div' and (a.get('role') == 'main' or 'body' in (a.get('class') or '').split()):
                self.depth = 1
            return
        if tag not in self.VOID: self.depth += 1
        if not self.skip_at and (tag in ('script', 'style') or
                                 (tag == 'a' and 'headerlink' in (a.get('class') or ''))):
            self.skip_at = self.depth
        if tag == 'pre': self.pre += 1
        if tag in self.BLOCK: self.out.append('\n')
    def handle_endtag(self, tag):
        if self.depth == 0 or tag in self.VOID: return
        if self.skip_at == self.depth: self.skip_at = 0
        self.depth -= 1
        if tag == 'pre' and self.pre: self.pre -= 1
        if tag in self.BLOCK: self.out.append('\n')
    def handle_data(self, data):
        if self.depth and not self.skip_at:
            self.out.append(data if self.pre else re.sub(r'\s+', ' ', data))

def page_text(path):
    p = MainText()
    with open(path, encoding='utf-8', errors='replace') as f:
        p.feed(f.read())
    lines = [l.strip() if not l.startswith(' ') else l.rstrip() for l in ''.join(p.out).split('\n')]
    text = re.sub(r'\n{3,}', '\n\n', '\n'.join(lines)).strip()
    return text.replace('\u00b6', '')

out_path, plain = sys.argv[1], sys.argv[2]
# python3.X-doc/html and python3.X-dev, -venv are links to python3.X/html: read each directory once
roots = sorted({os.path.realpath(r) for r in sys.argv[3:]})
pages = []
for d, dirs, files in os.walk(plain):
    dirs.sort()
    pages += [os.path.join(d, f) for f in sorted(files) if f.endswith('.txt')]
for root in roots:
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            rel = os.path.relpath(os.path.join(d, name), root)
            if name.endswith('.html') and not SKIP_PAGES.search(rel):
                pages.append(os.path.join(d, name))
def order_key(p):  # the plain files by their path inside $PLAIN, so the order does not depend on --out
    return hashlib.sha256((os.path.relpath(p, plain) if p.startswith(plain) else p).encode()).hexdigest()
pages.sort(key=order_key)
n = total = 0
with open(out_path, 'w', encoding='utf-8') as out:
    for path in pages:
        if path.endswith('.txt'):
            with open(path, encoding='utf-8', errors='replace') as f:
                text = f.read().strip()
        else:
            text = page_text(path)
        if len(text) < 200: continue   # redirect stubs and near-empty pages
        out.write(text + '\n\n')
        n += 1
        total += len(text.encode()) + 2
print(f"corpus.sh: {n} documents of {len(pages)} from {', '.join(roots)} and {plain}: {total:,} bytes")
PY
mv "$OUT/corpus.txt.tmp" "$OUT/corpus.txt"
bytes=$(stat -c %s "$OUT/corpus.txt")
{
  echo "corpus.txt: $bytes bytes, built by scripts/corpus.sh from:"
  dpkg-query -W -f '  ${Package} ${Version}\n' 'linux-doc-*' 'python3.*-doc' perl-doc 2>/dev/null | grep -v ' $' || true
} > "$OUT/SOURCES.txt"
cat "$OUT/SOURCES.txt"
if [ "$bytes" -lt "$MIN_BYTES" ]; then
  echo "corpus.sh: $OUT/corpus.txt has $bytes bytes; expected at least $MIN_BYTES (50 MB)" >&2
  exit 1
fi
"$BIN" prep --text "$OUT/corpus.txt" --out "$OUT/shards"
echo "corpus.sh: train on it with --set data.shards=$OUT/shards"
