#!/usr/bin/env bash
# Everything under DIR packed into DIR/results.tgz, the files themselves removed: a device call brings back
# at most 8 files from $OUT (the device README's limits), where a session's reports and logs are dozens.
#   bash tools/pack_out.sh DIR        (then, here: tar xzf .../results.tgz -C SOMEWHERE)
# The GPU scripts (gpu_session.sh, gpu_suites.sh) call it last unless PACK=0.
set -euo pipefail
dir=${1:?usage: pack_out.sh DIR}
[[ -d $dir ]] || exit 0
tmp=$(mktemp "${TMPDIR:-/tmp}/pack.XXXXXX.tgz")
tar czf "$tmp" -C "$dir" --exclude=./results.tgz --exclude='*.png' .
find "$dir" -mindepth 1 -maxdepth 1 ! -name results.tgz -exec rm -rf {} +
mv "$tmp" "$dir/results.tgz"
