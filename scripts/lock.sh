# Sourced by scripts/setup.sh, setup_lmdeploy.sh and setup_sglang.sh (with $here set to the checkout).
# Editable installs of this checkout write dlmix.egg-info into it, and setup.sh builds the three venvs at the same
# time: `locked CMD...` runs CMD holding one lock per checkout (flock, util-linux; without flock CMD just runs).
lock="${TMPDIR:-/tmp}/dlmix-setup-$(printf %s "$here" | sha256sum | cut -c1-12).lock"
locked() { if command -v flock >/dev/null; then flock "$lock" "$@"; else "$@"; fi; }
