#!/usr/bin/env bash
# Installs Duet as systemd services: the binaries, the units, one NUMA drop-in per
# cpu-worker instance (a node with CPUs), /etc/duet/duet.toml and /etc/duet/workers.env
# (only where absent), the `duet` system user, then `systemctl daemon-reload`.
#
#   deploy/install.sh                  install on this machine (as root)
#   deploy/install.sh --dry-run        print what it would do, change nothing
#   deploy/install.sh --prefix DIR     install into the staging root DIR (no root needed:
#                                      no user is created, systemd is not reloaded)
# Other options:
#   --bin-dir DIR   where the binaries are (default: target/release of this checkout;
#                   build them with `cargo build --release`)
#   --sysfs DIR     the sysfs `node` directory to read the NUMA nodes from
#                   (default: /sys/devices/system/node)
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
repo="$(dirname "$here")"
prefix=""
dry_run=0
bin_dir="$repo/target/release"
sysfs="/sys/devices/system/node"

usage() { sed -n '2,15s/^# \{0,1\}//p' "$0"; }
die() { echo "install.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) dry_run=1 ;;
        --prefix) [ $# -ge 2 ] || die "--prefix needs a directory"; prefix="${2%/}"; shift ;;
        --prefix=*) prefix="${1#--prefix=}"; prefix="${prefix%/}" ;;
        --bin-dir) [ $# -ge 2 ] || die "--bin-dir needs a directory"; bin_dir="$2"; shift ;;
        --bin-dir=*) bin_dir="${1#--bin-dir=}" ;;
        --sysfs) [ $# -ge 2 ] || die "--sysfs needs a directory"; sysfs="$2"; shift ;;
        --sysfs=*) sysfs="${1#--sysfs=}" ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument $1 (see --help)" ;;
    esac
    shift
done
if [ -n "$prefix" ]; then
    [ "${prefix#/}" != "$prefix" ] || prefix="$PWD/$prefix"
elif [ "$dry_run" = 0 ] && [ "$(id -u)" != 0 ]; then
    die "installing into / needs root (or use --prefix DIR, or --dry-run)"
fi

binaries=(duet-gateway duet-gpu-worker duet-cpu-worker)
units=(duet-gateway.service duet-gpu-worker.service duet-cpu-worker@.service)
bin_to="$prefix/usr/local/bin"
unit_to="$prefix/etc/systemd/system"
etc_to="$prefix/etc/duet"
doc_to="$prefix/usr/local/share/doc/duet"
state_to="$prefix/var/lib/duet"

# Runs a command, or with --dry-run prints it.
run() {
    if [ "$dry_run" = 1 ]; then
        printf '+'; printf ' %q' "$@"; printf '\n'
    else
        "$@"
    fi
}

# Writes stdin to file $1 with mode $2, or with --dry-run prints it.
write() {
    if [ "$dry_run" = 1 ]; then
        echo "+ write $1 (mode $2):"
        sed 's/^/    /'
    else
        local tmp
        tmp="$(mktemp "$1.XXXXXX")"
        cat > "$tmp"
        chmod "$2" "$tmp"
        mv -f "$tmp" "$1"
    fi
}

# --- What to install ----------------------------------------------------------------------

for b in "${binaries[@]}"; do
    [ -x "$bin_dir/$b" ] || die "$bin_dir/$b is missing: build it first (cargo build --release), or pass --bin-dir"
done
for f in "${units[@]}" duet.toml.example workers.env.example README.md; do
    [ -f "$here/$f" ] || die "$here/$f is missing"
done

# The NUMA nodes with CPUs and their CPU lists (memory-only nodes get no cpu-worker).
nodes=()
declare -A cpus_of=()
if [ -d "$sysfs" ]; then
    sysfs="$(cd "$sysfs" && pwd)"
    for dir in "$sysfs"/node[0-9]*; do
        [ -d "$dir" ] || continue
        id="${dir##*/node}"
        [[ "$id" =~ ^[0-9]+$ ]] || continue
        [ -r "$dir/cpulist" ] || die "cannot read $dir/cpulist"
        list="$(tr -d ' \n' < "$dir/cpulist")"
        [ -n "$list" ] || { echo "install.sh: NUMA node $id has no CPUs (memory only): no cpu-worker there"; continue; }
        [[ "$list" =~ ^[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*$ ]] || die "$dir/cpulist: bad CPU list '$list'"
        nodes+=("$id")
        cpus_of[$id]="$list"
    done
fi
if [ ${#nodes[@]} -eq 0 ]; then
    echo "install.sh: no NUMA nodes in $sysfs: one cpu-worker, node 0, without a NUMA drop-in"
    nodes=(0)
fi
mapfile -t nodes < <(printf '%s\n' "${nodes[@]}" | sort -n)
# The gateway expects worker k at position k of cpu_worker, and cpu-worker@N is worker N.
for i in "${!nodes[@]}"; do
    if [ "${nodes[$i]}" != "$i" ]; then
        echo "install.sh: warning: the nodes with CPUs are ${nodes[*]}, not 0..$(( ${#nodes[@]} - 1 )):" \
             "duet-cpu-worker@N is worker N, so give each instance --worker <its position> in a drop-in" >&2
        break
    fi
done

# --- Install ------------------------------------------------------------------------------

if [ "$dry_run" = 1 ]; then
    echo "install.sh: dry run: what installing into ${prefix:-/} would do"
else
    echo "install.sh: installing into ${prefix:-/}"
fi
run install -d -m 0755 "$bin_to" "$unit_to" "$doc_to"
for b in "${binaries[@]}"; do
    run install -m 0755 "$bin_dir/$b" "$bin_to/$b"
done
for u in "${units[@]}"; do
    run install -m 0644 "$here/$u" "$unit_to/$u"
done
run install -m 0644 "$here/README.md" "$doc_to/README.md"

# One drop-in per node with CPUs: the memory policy and CPU affinity systemd cannot derive
# from the instance name (see duet-cpu-worker@.service).
for n in "${nodes[@]}"; do
    [ -n "${cpus_of[$n]:-}" ] || continue
    run install -d -m 0755 "$unit_to/duet-cpu-worker@$n.service.d"
    write "$unit_to/duet-cpu-worker@$n.service.d/numa.conf" 0644 <<EOF
# Written by deploy/install.sh from $sysfs/node$n/cpulist.
# cpu-worker $n: its memory from NUMA node $n only, its threads on node $n's CPUs.
[Service]
NUMAPolicy=bind
NUMAMask=$n
CPUAffinity=${cpus_of[$n]}
EOF
done

# Configuration: never overwrites an existing file.
run install -d -m 0750 "$etc_to"
sockets="$(for n in "${nodes[@]}"; do printf '"unix:/run/duet/cpu%s.sock", ' "$n"; done)"
sockets="[${sockets%, }]"
if [ -e "$etc_to/duet.toml" ]; then
    echo "install.sh: keeping $etc_to/duet.toml"
else
    sed "s|^cpu_worker = .*|cpu_worker = $sockets|" "$here/duet.toml.example" | write "$etc_to/duet.toml" 0640
fi
if [ -e "$etc_to/workers.env" ]; then
    echo "install.sh: keeping $etc_to/workers.env"
else
    write "$etc_to/workers.env" 0640 < "$here/workers.env.example"
fi
run install -d -m 0750 "$state_to" "$state_to/models"

if [ -n "$prefix" ]; then
    echo "install.sh: staging root: not creating the duet user, not reloading systemd"
else
    if ! getent passwd duet >/dev/null; then
        run useradd --system --user-group --home-dir /var/lib/duet --no-create-home \
            --shell /usr/sbin/nologin --comment "Duet inference server" duet
    fi
    run chown root:duet "$etc_to" "$etc_to/duet.toml" "$etc_to/workers.env"
    run chown duet:duet "$state_to" "$state_to/models"
    if [ -d /run/systemd/system ]; then
        run systemctl daemon-reload
    else
        echo "install.sh: systemd is not running: skipping daemon-reload"
    fi
fi

instances="$(printf 'duet-cpu-worker@%s ' "${nodes[@]}")"
cat <<EOF
install.sh: done. Next:
  put the model at /var/lib/duet/models/model.gguf (or change DUET_MODEL in /etc/duet/workers.env
  and model in /etc/duet/duet.toml), set DUET_KV_BYTES, then:
  systemctl enable --now ${instances}duet-gpu-worker duet-gateway
EOF
