#!/usr/bin/env bash
# Render the reports in headless Chromium, as a reader would see them. Runs a small real training
# (with one injected worker kill, so the failure section has content) and a small scaling sweep,
# then for report.html and scale_report.html checks:
#   (a) the page loads without console errors or failed loads (Chromium's log) and the rendered
#       DOM holds the expected sections and inline SVG charts;
#   (b) a 1200×3000 screenshot is produced and is not blank (a PNG decoder below counts colours
#       and non-white pixels).
# Control pages are checked first, one per check, each failing exactly that check and a good one
# passing them all, so the checks are known to catch what they claim.
# Usage: scripts/chromium-check.sh path/to/lockstep [screenshot-dir]
# Offline: the pages are local files and Chromium's background networking is off.
set -euo pipefail
bin="$(realpath "${1:?usage: $0 path/to/lockstep [screenshot-dir]}")"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
shots="${2:-$work/shots}"
mkdir -p "$shots"
chromium="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}"
if [[ -z "$chromium" ]]; then
    echo "chromium-check: chromium not found (Debian: apt-get install -y chromium)" >&2
    exit 1
fi

# Chromium with everything that could reach the network or pop a dialog turned off; a fresh
# profile per call. Output files stay under $work.
browse() {
    local profile
    profile="$(mktemp -d "$work/profile.XXXX")"
    timeout 120 "$chromium" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$profile" "$@"
}

# check NAME FILE MIN_SVGS SECTION... : exit status 1 with a reason when a check fails.
check() {
    local name="$1" file="$2" min_svgs="$3"
    shift 3
    local log="$work/$name.log" dom="$work/$name.dom.html" png="$shots/$name.png"
    if ! browse --enable-logging=stderr --v=0 --dump-dom "file://$file" >"$dom" 2>"$log"; then
        echo "chromium-check: $name: chromium failed to load the page:" >&2
        tail -5 "$log" >&2
        return 1
    fi
    # The reports run no scripts, so any console message at all is a fault.
    if grep -E "CONSOLE|Uncaught" "$log" >"$work/$name.errors"; then
        echo "chromium-check: $name: console messages:" >&2
        cat "$work/$name.errors" >&2
        return 1
    fi
    # Self-contained: no loads from anywhere (the only URL is the SVG namespace).
    if grep -oE "(src|href)=|https?://[^\"' ]*" "$dom" | grep -v "^http://www.w3.org/2000/svg$" >"$work/$name.external"; then
        echo "chromium-check: $name: external references:" >&2
        cat "$work/$name.external" >&2
        return 1
    fi
    local svgs
    svgs="$(grep -o "<svg" "$dom" | wc -l)"
    if ((svgs < min_svgs)); then
        echo "chromium-check: $name: $svgs inline SVG chart(s) rendered, expected at least $min_svgs" >&2
        return 1
    fi
    local id
    for id in "$@"; do
        if ! grep -q "<section id=\"$id\">" "$dom"; then
            echo "chromium-check: $name: section \"$id\" missing from the rendered page" >&2
            return 1
        fi
    done
    rm -f "$png"
    browse --screenshot="$png" --window-size=1200,3000 "file://$file" >"$work/$name.shot.log" 2>&1 || true
    if [[ ! -s "$png" ]]; then
        echo "chromium-check: $name: no screenshot written" >&2
        tail -5 "$work/$name.shot.log" >&2
        return 1
    fi
    python3 - "$png" "$name" <<'EOF'
# Decode the PNG (8-bit RGB/RGBA, non-interlaced: what Chromium writes) with zlib alone and
# refuse a blank page: too few colours or almost nothing but white.
import struct, sys, zlib

path, name = sys.argv[1], sys.argv[2]
data = open(path, "rb").read()
if data[:8] != b"\x89PNG\r\n\x1a\n":
    sys.exit(f"chromium-check: {name}: {path} is not a PNG")
pos, idat, ihdr = 8, b"", None
while pos < len(data):
    (length,) = struct.unpack(">I", data[pos : pos + 4])
    kind = data[pos + 4 : pos + 8]
    body = data[pos + 8 : pos + 8 + length]
    if kind == b"IHDR":
        ihdr = struct.unpack(">IIBBBBB", body)
    elif kind == b"IDAT":
        idat += body
    pos += 12 + length
width, height, depth, colour, _, _, interlace = ihdr
if depth != 8 or colour not in (2, 6) or interlace:
    sys.exit(f"chromium-check: {name}: unexpected PNG format {ihdr}")
bpp = 3 if colour == 2 else 4
stride = width * bpp
raw = zlib.decompress(idat)
prev = bytearray(stride)
colours, white, total = set(), 0, 0
for y in range(height):
    f = raw[y * (stride + 1)]
    line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
    if f == 1:
        for i in range(bpp, stride):
            line[i] = (line[i] + line[i - bpp]) & 255
    elif f == 2:
        line = bytearray((a + b) & 255 for a, b in zip(line, prev))
    elif f == 3:
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            line[i] = (line[i] + ((left + prev[i]) >> 1)) & 255
    elif f == 4:
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], (prev[i - bpp] if i >= bpp else 0)
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
            line[i] = (line[i] + pred) & 255
    prev = line
    if y % 4 == 0:  # a sample of rows is plenty for the counts
        for x in range(0, stride, bpp * 2):
            px = bytes(line[x : x + 3])
            colours.add(px)
            white += px == b"\xff\xff\xff"
            total += 1
inked = 1 - white / total
print(f"chromium-check: {name}: {width}x{height} screenshot, {len(colours)} colours, {inked:.1%} non-white")
if len(colours) < 16 or inked < 0.02:
    sys.exit(f"chromium-check: {name}: the screenshot looks blank")
EOF
}

# 0. Every check must be able to fail: one control page per check, each passing all the checks
# before its own, and each must fail with that check's reason (a control failing for another
# reason would prove nothing about its check). Chromium failing to start and a missing
# screenshot are failures of the environment, not of a page, and have no control page.
page='<!DOCTYPE html><html><body><section id="x"><svg xmlns="http://www.w3.org/2000/svg"></svg></section>'
# Fills the screenshot with many colours, so that only the check under test can fail.
ink='<svg xmlns="http://www.w3.org/2000/svg" width="1200" height="2000">'
for i in $(seq 0 31); do
    ink+="<rect x=\"0\" y=\"$((i * 60))\" width=\"1200\" height=\"60\" fill=\"rgb($((i * 8)),$((255 - i * 8)),128)\"/>"
done
ink+='</svg>'
echo "$page$ink<script>undefinedFunction();</script></body></html>" >"$work/script-error.html"
# An anchor loads nothing, so this control fails only the external-reference check.
echo "$page$ink<a href=\"https://example.invalid/\">elsewhere</a></body></html>" >"$work/external.html"
echo "<!DOCTYPE html><html><body><section id=\"x\">no chart</section></body></html>" >"$work/no-svg.html"
echo "$page$ink</body></html>" >"$work/no-section.html"
echo "$page</body></html>" >"$work/blank.html"
# control NAME REASON SECTION: check NAME's page (at least 1 SVG, section SECTION) must fail with
# a message matching REASON.
control() {
    local name="$1" reason="$2" section="$3"
    if check "$name" "$work/$name.html" 1 "$section" 2>"$work/$name.control"; then
        echo "chromium-check: the control page $name.html passed: the check for \"$reason\" does not work here" >&2
        exit 1
    fi
    if ! grep -qE "$reason" "$work/$name.control"; then
        echo "chromium-check: the control page $name.html failed, but not with \"$reason\":" >&2
        cat "$work/$name.control" >&2
        exit 1
    fi
}
control script-error "script-error: console messages" x
control external "external: external references" x
control no-svg "no-svg: 0 inline SVG chart" x
control no-section 'no-section: section "missing-id" missing' missing-id
control blank "blank: the screenshot looks blank" x
# And the controls' common part passes every check, so the failures above are the checks' doing.
echo "$page$ink</body></html>" >"$work/good.html"
if ! check good "$work/good.html" 1 x >"$work/good.control" 2>&1; then
    echo "chromium-check: the well-formed control page good.html failed:" >&2
    cat "$work/good.control" >&2
    exit 1
fi

# 1. A real run with a failure and a restart, and a real sweep.
"$bin" train --nproc 2 --out "$work/run" --set train.steps=40 --set train.eval_every=10 \
    --set checkpoint.every=10 --inject kill:rank=1,step=25 >"$work/train.log" 2>&1 ||
    { cat "$work/train.log" >&2; exit 1; }
"$bin" scale --nproc 1,2 --out "$work/sweep" --set train.steps=30 >"$work/scale.log" 2>&1 ||
    { cat "$work/scale.log" >&2; exit 1; }

# 2. Both reports.
check report "$work/run/report.html" 4 headline loss evals throughput ranks failures
check scale_report "$work/sweep/scale_report.html" 4 verdict speedup breakdown loss final hashes
if [[ -n "${2:-}" ]]; then
    echo "chromium-check: ok (screenshots in $shots)"
else
    echo "chromium-check: ok"
fi
