#!/usr/bin/env bash
# Tests deploy/: installs with deploy/install.sh --prefix into temporary roots (stub
# binaries; the NUMA nodes of the one-, two- and four-node sysfs fixtures in
# topology/tests/fixtures/sysfs), checks what landed, runs `systemd-analyze verify --root` on
# the installed units (failing on any message, since verify exits 0 on many warnings), and
# checks every key of deploy/duet.toml.example against `duet-gateway serve`'s flags.
#
#   tests/deploy.sh     (needs systemd-analyze and a built duet-gateway: cargo build -p duet-gateway;
#                        DUET_GATEWAY=path overrides target/debug/duet-gateway)
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "tests/deploy.sh: FAIL: $*" >&2; exit 1; }
pass() { echo "ok: $*"; }

command -v systemd-analyze >/dev/null || fail "systemd-analyze is not installed"
gateway="${DUET_GATEWAY:-target/debug/duet-gateway}"
[ -x "$gateway" ] || fail "$gateway is missing: cargo build -p duet-gateway"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/duet-deploy-test.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/bin"
for b in duet-gateway duet-gpu-worker duet-cpu-worker; do
    printf '#!/bin/sh\necho stub %s\n' "$b" > "$tmp/bin/$b"
    chmod 0755 "$tmp/bin/$b"
done
fixtures=topology/tests/fixtures/sysfs

# `systemd-analyze verify --root=ROOT UNIT...` must exit 0 and say nothing at all.
verify() {
    local root="$1" out
    shift
    if ! out="$(systemd-analyze verify --root="$root" "$@" 2>&1)"; then
        fail "systemd-analyze verify $* failed:"$'\n'"$out"
    fi
    [ -z "$out" ] || fail "systemd-analyze verify $* warned:"$'\n'"$out"
}

# Installs for fixture $1 into a new root; checks the result for the nodes with CPUs $2
# (space-separated) and verifies the units.
install_for() {
    local fixture="$1" want_nodes="$2" root="$tmp/root-$1" out n
    out="$(deploy/install.sh --prefix "$root" --bin-dir "$tmp/bin" --sysfs "$fixtures/$fixture")" \
        || fail "install.sh --prefix for $fixture failed:"$'\n'"$out"
    for b in duet-gateway duet-gpu-worker duet-cpu-worker; do
        [ -x "$root/usr/local/bin/$b" ] || fail "$fixture: /usr/local/bin/$b not installed"
        cmp -s "$tmp/bin/$b" "$root/usr/local/bin/$b" || fail "$fixture: /usr/local/bin/$b differs from its source"
    done
    for u in duet-gateway.service duet-gpu-worker.service duet-cpu-worker@.service; do
        cmp -s "deploy/$u" "$root/etc/systemd/system/$u" || fail "$fixture: unit $u not installed as is"
    done
    [ -f "$root/usr/local/share/doc/duet/README.md" ] || fail "$fixture: README not installed"
    [ -d "$root/var/lib/duet/models" ] || fail "$fixture: /var/lib/duet/models not created"
    [ "$(stat -c %a "$root/etc/duet/duet.toml")" = 640 ] || fail "$fixture: duet.toml is not mode 0640"
    [ "$(stat -c %a "$root/etc/duet/workers.env")" = 640 ] || fail "$fixture: workers.env is not mode 0640"
    cmp -s deploy/workers.env.example "$root/etc/duet/workers.env" || fail "$fixture: workers.env differs from the example"

    # One NUMA drop-in per node with CPUs, none for memory-only nodes.
    local dropins sockets="" instances=""
    dropins="$(cd "$root/etc/systemd/system" && ls -d duet-cpu-worker@*.service.d 2>/dev/null | sort -V | tr '\n' ' ')"
    local want_dropins=""
    for n in $want_nodes; do
        want_dropins+="duet-cpu-worker@$n.service.d "
        sockets+="\"unix:/run/duet/cpu$n.sock\", "
        instances+="duet-cpu-worker@$n "
        local conf="$root/etc/systemd/system/duet-cpu-worker@$n.service.d/numa.conf"
        local cpus
        cpus="$(tr -d '\n' < "$fixtures/$fixture/node$n/cpulist")"
        grep -qx "NUMAPolicy=bind" "$conf" || fail "$fixture: $conf lacks NUMAPolicy=bind"
        grep -qx "NUMAMask=$n" "$conf" || fail "$fixture: $conf lacks NUMAMask=$n"
        grep -qx "CPUAffinity=$cpus" "$conf" || fail "$fixture: $conf lacks CPUAffinity=$cpus"
    done
    [ "$dropins" = "$want_dropins" ] || fail "$fixture: drop-ins are '$dropins', expected '$want_dropins'"

    # The gateway's config names exactly these cpu-workers; the rest is the example's.
    grep -qxF "cpu_worker = [${sockets%, }]" "$root/etc/duet/duet.toml" \
        || fail "$fixture: duet.toml's cpu_worker is $(grep '^cpu_worker' "$root/etc/duet/duet.toml")"
    diff <(grep -v '^cpu_worker' deploy/duet.toml.example) <(grep -v '^cpu_worker' "$root/etc/duet/duet.toml") >/dev/null \
        || fail "$fixture: duet.toml differs from the example beyond cpu_worker"
    grep -qF "systemctl enable --now ${instances}duet-gpu-worker duet-gateway" <<<"$out" \
        || fail "$fixture: install.sh did not print the enable line for ${instances}:"$'\n'"$out"

    # systemd's verdict on the installed units, drop-ins included. The root needs systemd's
    # own units (sysinit.target, ...) for the default dependencies.
    mkdir -p "$root/usr/lib/systemd"
    cp -a /usr/lib/systemd/system "$root/usr/lib/systemd/"
    local units=(duet-gateway.service duet-gpu-worker.service)
    for n in $want_nodes; do units+=("duet-cpu-worker@$n.service"); done
    verify "$root" "${units[@]}"
    pass "$fixture: installed; nodes with CPUs: $want_nodes; systemd-analyze verify: ${units[*]}"
}

install_for one-node "0"
install_for two-node "0 1"
install_for four-node "0 1"   # nodes 2 and 3 are memory-only (HBM)

# The verify check catches what it should: NUMAMask=%i (systemd does not expand it), a
# missing binary, an unknown key.
root="$tmp/root-two-node"
unit="$root/etc/systemd/system/duet-cpu-worker@.service"
cp "$unit" "$tmp/cpu.orig"
printf '[Service]\nNUMAMask=%%i\n' >> "$unit"
if (verify "$root" duet-cpu-worker@0.service) 2>/dev/null; then fail "verify accepted NUMAMask=%i"; fi
cp "$tmp/cpu.orig" "$unit"
printf '[Service]\nNoSuchKey=1\n' >> "$unit"
if (verify "$root" duet-cpu-worker@0.service) 2>/dev/null; then fail "verify accepted an unknown key"; fi
cp "$tmp/cpu.orig" "$unit"
mv "$root/usr/local/bin/duet-gateway" "$tmp/gw"
if (verify "$root" duet-gateway.service) 2>/dev/null; then fail "verify accepted a missing ExecStart binary"; fi
mv "$tmp/gw" "$root/usr/local/bin/duet-gateway"
verify "$root" duet-gateway.service duet-cpu-worker@0.service
pass "systemd-analyze verify refuses NUMAMask=%i, unknown keys and missing binaries"

# A second install keeps the administrator's configuration.
echo "# edited" >> "$root/etc/duet/duet.toml"
echo "# edited" >> "$root/etc/duet/workers.env"
out="$(deploy/install.sh --prefix "$root" --bin-dir "$tmp/bin" --sysfs "$fixtures/two-node")"
tail -n1 "$root/etc/duet/duet.toml" | grep -qx "# edited" || fail "a second install replaced duet.toml"
tail -n1 "$root/etc/duet/workers.env" | grep -qx "# edited" || fail "a second install replaced workers.env"
grep -q "keeping .*/etc/duet/duet.toml" <<<"$out" || fail "install.sh did not say it kept duet.toml"
pass "a second install keeps /etc/duet/duet.toml and workers.env"

# --dry-run prints and changes nothing.
out="$(deploy/install.sh --dry-run --prefix "$tmp/dry" --bin-dir "$tmp/bin" --sysfs "$fixtures/two-node")"
[ ! -e "$tmp/dry" ] || fail "--dry-run created $(find "$tmp/dry" | head -5)"
grep -qF "$tmp/dry/usr/local/bin/duet-gateway" <<<"$out" || fail "--dry-run did not show the binaries' install:"$'\n'"$out"
grep -qF "NUMAMask=1" <<<"$out" || fail "--dry-run did not show the NUMA drop-ins"
pass "install.sh --dry-run prints the steps and writes nothing"

# Bad input is refused.
if deploy/install.sh --prefix "$tmp/x" --bin-dir "$tmp/nowhere" --sysfs "$fixtures/two-node" >/dev/null 2>&1; then
    fail "install.sh accepted a missing --bin-dir"
fi
if deploy/install.sh --no-such-flag >/dev/null 2>&1; then fail "install.sh accepted an unknown flag"; fi
mkdir -p "$tmp/badsysfs/node0"
echo "0-3,x" > "$tmp/badsysfs/node0/cpulist"
if deploy/install.sh --prefix "$tmp/y" --bin-dir "$tmp/bin" --sysfs "$tmp/badsysfs" >/dev/null 2>&1; then
    fail "install.sh accepted a garbled cpulist"
fi
pass "install.sh refuses missing binaries, unknown flags and a garbled cpulist"

# Every key of the example config (commented-out ones too) is a `serve` flag, and the
# gateway accepts the file as it stands.
help="$("$gateway" serve --help)"
grep -q -- "--config" <<<"$help" || fail "$gateway serve has no --config flag (stale build? cargo build -p duet-gateway)"
keys="$(sed -nE 's/^#?([a-z_]+) = .*/\1/p' deploy/duet.toml.example)"
[ -n "$keys" ] || fail "no keys found in deploy/duet.toml.example"
for key in $keys; do
    # (A switch's line ends at its name; a flag with a value has a space and the value.)
    grep -qE -- "--${key//_/-}( |\$)" <<<"$help" || fail "deploy/duet.toml.example: key $key is not a flag of duet-gateway serve"
done
# And every flag (but --config itself and --api-key, whose secret belongs in api_key_file)
# is documented there.
for flag in $(grep -oE -- '^ +--[a-z-]+' <<<"$help" | tr -d ' ' | sort -u); do
    key="${flag#--}"; key="${key//-/_}"
    case "$key" in help|config|api_key) continue ;; esac
    grep -qx "$key" <<<"$keys" || fail "deploy/duet.toml.example does not document $key"
done
printed="$("$gateway" config --print --config deploy/duet.toml.example)" \
    || fail "duet-gateway refused deploy/duet.toml.example"
grep -q 'gpu_worker = "unix:/run/duet/gpu.sock"' <<<"$printed" || fail "config --print lacks gpu_worker:"$'\n'"$printed"
pass "deploy/duet.toml.example: $(wc -w <<<"$keys") keys, all serve flags; the gateway accepts it"

echo "tests/deploy.sh: all passed"
