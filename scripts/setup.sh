#!/usr/bin/env bash
# Installs the datasets lockstep does not carry in the repository and checks the ones it does.
#
# - sklearn digits: committed as data/digits/digits.csv.gz; only its checksum is verified here.
# - Fashion-MNIST: Debian package `dataset-fashion-mnist`, which installs gzipped IDX files into
#   /usr/share/datasets/fashion-mnist/. Installed with apt because it is the one registry reachable
#   from every machine this project runs on (no direct internet), and because the package pins the
#   exact bytes.
#
# Idempotent: a second run does nothing but the checks. Needs root (or sudo) only when it has to
# install something. Exits non-zero, naming what is missing, if a dataset is not in place afterwards.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
fashion_dir=/usr/share/datasets/fashion-mnist
fashion_files=(
    train-images-idx3-ubyte.gz
    train-labels-idx1-ubyte.gz
    t10k-images-idx3-ubyte.gz
    t10k-labels-idx1-ubyte.gz
)
digits_file="$repo_root/data/digits/digits.csv.gz"
# sha256 of sklearn/datasets/data/digits.csv.gz in scikit_learn-1.7.2 (see data/README.md).
digits_sha256=09f66e6debdee2cd2b5ae59e0d6abbb73fc2b0e0185d2e1957e9ebb51e23aa22

die() {
    echo "setup.sh: error: $*" >&2
    exit 1
}

# --- digits (committed) -----------------------------------------------------------------------
[[ -f "$digits_file" ]] || die "$digits_file is missing (it is committed to the repository; restore it with git)"
actual="$(sha256sum "$digits_file" | cut -d' ' -f1)"
[[ "$actual" == "$digits_sha256" ]] ||
    die "$digits_file has sha256 $actual, expected $digits_sha256 (file modified or corrupted)"
echo "setup.sh: digits ok ($digits_file)"

# --- Palmer penguins (committed; examples/own-tabular) -------------------------------------------
penguins_file="$repo_root/data/penguins/penguins.csv"
penguins_sha256=f204db2c753b0937caac3cb35258562c14f073e4bbc76be24b4c51ce22767a93
[[ -f "$penguins_file" ]] || die "$penguins_file is missing (it is committed to the repository; restore it with git)"
actual="$(sha256sum "$penguins_file" | cut -d' ' -f1)"
[[ "$actual" == "$penguins_sha256" ]] ||
    die "$penguins_file has sha256 $actual, expected $penguins_sha256 (file modified or corrupted)"
echo "setup.sh: penguins ok ($penguins_file)"

# --- Fashion-MNIST (apt) ----------------------------------------------------------------------
fashion_complete() {
    local f
    for f in "${fashion_files[@]}"; do
        [[ -s "$fashion_dir/$f" ]] || return 1
    done
}

if fashion_complete; then
    echo "setup.sh: Fashion-MNIST already installed in $fashion_dir"
else
    if [[ "$(id -u)" -eq 0 ]]; then
        as_root=()
    elif command -v sudo >/dev/null 2>&1; then
        as_root=(sudo)
    else
        die "installing dataset-fashion-mnist needs root; rerun as root or install sudo"
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "no apt-get here: on a non-Debian system put the four Fashion-MNIST files (${fashion_files[*]}) into $fashion_dir yourself"
    export DEBIAN_FRONTEND=noninteractive
    # The package index may be empty in fresh containers, so update once before installing.
    "${as_root[@]}" apt-get update
    "${as_root[@]}" apt-get install -y --no-install-recommends dataset-fashion-mnist
fi

for f in "${fashion_files[@]}"; do
    [[ -s "$fashion_dir/$f" ]] ||
        die "$fashion_dir/$f is missing after installing dataset-fashion-mnist"
done

# Checksums of Debian bookworm's dataset-fashion-mnist 0.0~git20200523.55506a9-1. A mismatch is an
# error: runs are meant to be comparable bit for bit across machines, and a recompressed or damaged
# file would silently break that (or fail later, mid-run, with a less helpful message). Every file is
# checked before failing, so one run names all the mismatches.
fashion_sha256=(
    b0564c3eedabfbf835052cff8503ea422014ce006caf5b757f851416ee8300c7
    0ae29f65d86684f32d1b9c85147786c547b9c6aebcaf235f0400a0cce308b056
    cc1d090a38ace84dfa1aa66e3ada7c336ef481a96936906477e6dd344da56eaa
    8d3605d196f4be44669e46906da9733c8131fef761fdbfec72c424d5222f1a05
)
mismatches=0
for i in "${!fashion_files[@]}"; do
    f="$fashion_dir/${fashion_files[$i]}"
    actual="$(sha256sum "$f" | cut -d' ' -f1)"
    if [[ "$actual" != "${fashion_sha256[$i]}" ]]; then
        echo "setup.sh: error: $f has sha256 $actual, expected ${fashion_sha256[$i]}" \
            "(a different dataset-fashion-mnist version, or a damaged file: reinstall with" \
            "apt-get install --reinstall dataset-fashion-mnist)" >&2
        mismatches=$((mismatches + 1))
    fi
done
[[ "$mismatches" -eq 0 ]] ||
    die "$mismatches Fashion-MNIST file(s) in $fashion_dir do not match the pinned checksums"
echo "setup.sh: Fashion-MNIST ok ($fashion_dir)"
