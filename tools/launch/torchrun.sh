#!/usr/bin/env bash
# opid-train under torchrun (torch.distributed.run) with c10d rendezvous: one node or many.
#
#   tools/launch/torchrun.sh --config configs/x.yaml [--run-dir D | --resume RUN_DIR] [key=value ...]
#
# Everything after the script name goes to opid-train verbatim, after `--resume auto` (added unless the arguments
# have --resume or --overwrite): a SLURM requeue or a torchrun --max-restarts restart re-runs this same command line
# and so continues the run from its last complete checkpoint (or starts it when it has none; docs/runs.md). Run it
# once per node (by hand, or `srun` in
# tools/launch/opid.sbatch); each node's torchrun agent starts NPROC_PER_NODE ranks of opid-train and the agents meet
# at RDZV_ENDPOINT.
#
# Environment (defaults in brackets):
#   NNODES          nodes in the job [the config's deploy.nodes]
#   NPROC_PER_NODE  ranks per node [the config's training GPUs per node: deploy.train_gpus_per_node, or what the
#                   placement leaves for training (opid_mega.placement); on CPU configs a "GPU" is one rank]. Both
#                   come from the config; a value given here that disagrees is an error (one line, exit 2).
#   NODE_RANK       this node's index, 0 = the node at RDZV_ENDPOINT [unset]. With c10d rendezvous torchrun itself
#                   numbers the nodes (sorted by host name), so NODE_RANK only decides which node hosts the
#                   rendezvous store (--rdzv-conf is_host=1 on node 0, 0 elsewhere); unset, torchrun hosts it on the
#                   node whose host name/address matches RDZV_ENDPOINT. With RDZV_BACKEND=static it is the node rank.
#   NODE_ADDR       this node's address on the cluster network [unset: torchrun uses the host name's]: torchrun
#                   --local-addr, the address the other nodes reach this node's agent at (on the rank-0 node also the
#                   address its workers advertise as MASTER_ADDR); set it on multi-homed nodes, or where the host name
#                   resolves to a loopback address (stock Debian/Ubuntu /etc/hosts: 127.0.1.1)
#   RDZV_ENDPOINT   host:port of the rendezvous store [1 node: localhost and a free port; more: localhost:29400]
#   RDZV_ID         the job's rendezvous id, the same on every node [$SLURM_JOB_ID, else opid-<user>]
#   RDZV_BACKEND    c10d | static [c10d]
#   MAX_RESTARTS    torchrun --max-restarts [0]
#   PYTHON          the interpreter [python3 on PATH]
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME  the interface of the ranks' gloo / NCCL traffic [the interface holding
#                   NODE_ADDR, else the one that routes to the rendezvous host: lo in a one-node run]
#   OMP_NUM_THREADS torch threads per rank [the cores this node may use / NPROC_PER_NODE, as opid-train's own]
#   OPID_LAUNCH_DRY_RUN=1  check and print the torchrun command, do not run it
#
# Before anything starts, tools/launch/preflight.py loads the config with the same arguments, takes the node count
# and ranks per node from its deploy section, checks this node's GPUs against deploy.gpus_per_node (GPU configs)
# and the parallel layout for the world size NNODES x NPROC_PER_NODE: a bad key, layout or count ends here with one
# line and exit code 2 (the same checks opid-train makes in every rank, without waiting for the other nodes).
# Verified on one machine as 2 simulated nodes x 2 ranks (tests/launch/test_launch.py) and on a simulated cluster
# of 2 network namespaces, each its own address and host name (tools/cluster_sim.py, tests/launch/test_cluster.py).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
RDZV_BACKEND="${RDZV_BACKEND:-c10d}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"

case "$RDZV_BACKEND" in c10d|static) ;; *) echo "torchrun.sh: RDZV_BACKEND=$RDZV_BACKEND, allowed: c10d, static" >&2; exit 2 ;; esac
if [[ -n "${NNODES:-}" && ! "$NNODES" =~ ^[1-9][0-9]*$ ]]; then echo "torchrun.sh: NNODES=$NNODES, allowed: an integer >= 1" >&2; exit 2; fi
if [[ -n "${NPROC_PER_NODE:-}" && ! "$NPROC_PER_NODE" =~ ^[1-9][0-9]*$ ]]; then
  echo "torchrun.sh: NPROC_PER_NODE=$NPROC_PER_NODE, allowed: an integer >= 1" >&2; exit 2
fi

resume=(--resume auto)  # a re-run of this command line continues the run (see the top)
overwrite=0
for a in "$@"; do case "$a" in --resume|--resume=*) resume=() ;; --overwrite) resume=(); overwrite=1 ;; esac; done
if [[ "$overwrite" == 1 ]]; then
  # --overwrite moves the run directory's progress aside: on a restart of this same command line it would move the
  # job's own checkpoints away. A torchrun restart re-runs opid-train with the same arguments: refused. A SLURM
  # requeue (SLURM_RESTART_COUNT > 0) continues the run instead: --overwrite is taken on the first start only.
  if [[ "$MAX_RESTARTS" != 0 ]]; then
    echo "torchrun.sh: --overwrite with MAX_RESTARTS=$MAX_RESTARTS: every restart would move the run's own progress aside; start once with --overwrite (MAX_RESTARTS=0), or drop --overwrite (restarts continue the run: --resume auto)" >&2
    exit 2
  fi
  if [[ "${SLURM_RESTART_COUNT:-0}" != 0 ]]; then
    args=()
    for a in "$@"; do [[ "$a" == --overwrite ]] || args+=("$a"); done
    set -- ${args[@]+"${args[@]}"}
    resume=(--resume auto)
    echo "torchrun.sh: requeued job (SLURM_RESTART_COUNT=$SLURM_RESTART_COUNT): --overwrite applied on the first start only; continuing the run (--resume auto)" >&2
  fi
fi

# node count and ranks per node from the config (for a resume: the run's config.yaml, its recorded resume overrides
# and these), checked against NNODES / NPROC_PER_NODE when given, this node's GPUs and the layout for that world
# size; prints "NNODES NPROC_PER_NODE THREADS_PER_RANK"
read -r NNODES NPROC THREADS < <("$PYTHON" "$HERE/preflight.py" --nnodes "${NNODES:-}" --nproc-per-node "${NPROC_PER_NODE:-}" -- ${resume[@]+"${resume[@]}"} "$@" || echo FAIL)
if [[ "$NNODES" == FAIL || -z "$NPROC" ]]; then exit 2; fi  # preflight printed why
if [[ -n "${NODE_RANK:-}" ]] && ! [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]]; then
  echo "torchrun.sh: NODE_RANK=$NODE_RANK, allowed: 0 .. NNODES-1 = $((NNODES - 1))" >&2; exit 2
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$THREADS}"  # else torchrun forces 1 thread on every rank

if [[ -z "${RDZV_ENDPOINT:-}" ]]; then
  if [[ "$NNODES" == 1 ]]; then
    RDZV_ENDPOINT="localhost:$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')"
  else
    RDZV_ENDPOINT="localhost:29400"
  fi
fi
RDZV_ID="${RDZV_ID:-${SLURM_JOB_ID:-opid-${USER:-$(id -un)}}}"

# the interface gloo and NCCL use, unless set: the one holding NODE_ADDR, else the one that routes to the rendezvous
# host (loopback in a one-node run); a rendezvous host NAME that resolves to loopback on a multi-node run (this is
# node 0 under a stock hosts file) gives this node's one cluster interface, and with several it is one line naming
# the fix, exit 2 (opid_mega.infra.hosts.socket_ifname; opid-train's ranks apply the same rule at process-group
# set-up, for the launches that do not come through here). Without it gloo takes the address the host name
# resolves to: 127.0.1.1 under a stock Debian/Ubuntu /etc/hosts, which the other nodes cannot reach.
# (A dry run only reports a problem: it may name hosts that do not resolve here.)
if [[ -z "${GLOO_SOCKET_IFNAME:-}" || -z "${NCCL_SOCKET_IFNAME:-}" ]]; then
  if ifname="$("$PYTHON" -m opid_mega.infra.hosts socket-ifname "${RDZV_ENDPOINT%:*}" "$NNODES" "${NODE_ADDR:-}" 2>&1)"; then
    export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$ifname}" NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-$ifname}"
    echo "torchrun.sh: GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME" >&2
  elif [[ "${OPID_LAUNCH_DRY_RUN:-0}" == 1 ]]; then
    echo "torchrun.sh: (dry run) $ifname" >&2
  else
    echo "$ifname" >&2
    exit 2
  fi
fi

cmd=("$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS")
if [[ "$RDZV_BACKEND" == static ]]; then
  host="${RDZV_ENDPOINT%:*}" port="${RDZV_ENDPOINT##*:}"
  cmd+=(--rdzv-backend static --node-rank "${NODE_RANK:-0}" --master-addr "$host" --master-port "$port")
else
  cmd+=(--rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "$RDZV_ID")
  if [[ -n "${NODE_RANK:-}" ]]; then
    cmd+=(--rdzv-conf "is_host=$([[ "$NODE_RANK" == 0 ]] && echo 1 || echo 0)")
  fi
fi
if [[ -n "${NODE_ADDR:-}" ]]; then cmd+=(--local-addr "$NODE_ADDR"); fi  # this node's cluster address
cmd+=(-m opid_mega.cli ${resume[@]+"${resume[@]}"} "$@")  # opid_mega.cli is opid-train's entry point (train_main)

# the command as shown: secret override values (analyzer.api_key=...) and --api-key values as *** (opid_mega.infra.redact)
shown="$("$PYTHON" -c 'import shlex, sys; from opid_mega.infra.redact import redact_args; print(shlex.join(redact_args(sys.argv[1:])))' "${cmd[@]}" 2>/dev/null)" ||
  shown="$(printf '%q ' "${cmd[@]}" | sed -E 's/((^| )[^ =]*(api[_-]?key|token|password|secret)=)[^ ]*/\1***/Ig; s/(--api-key )[^ ]*/\1***/g')"
echo "torchrun.sh: node ${NODE_RANK:-?}/$NNODES, OMP_NUM_THREADS=$OMP_NUM_THREADS: $shown" >&2
if [[ "${OPID_LAUNCH_DRY_RUN:-0}" == 1 ]]; then exit 0; fi
exec "${cmd[@]}"
