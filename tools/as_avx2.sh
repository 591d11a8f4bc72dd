#!/usr/bin/env bash
# Run a command as on an AVX2-only x86 machine (the slowest kind CI has seen), to size the suite's time
# budget without one: /proc/cpuinfo loses its AVX-512 and AMX flags (contextkit, and so the suite's vLLM
# servers, then pick float32: core.config.cpu_has_fast_bf16), and torch, oneDNN and MKL are held to AVX2.
# vLLM's own CPU kernels still choose their instructions by CPUID, so the time is a lower bound on what
# an AVX2 machine takes. Needs root (a private mount namespace; nothing outside the command sees it).
#
#   tools/as_avx2.sh make test
set -euo pipefail
masked=$(mktemp)
trap 'rm -f "$masked"' EXIT
sed -E 's/ (avx512[a-z_0-9]*|amx[a-z_0-9]*)//g' /proc/cpuinfo > "$masked"
unshare -m bash -c 'mount --bind "$0" /proc/cpuinfo &&
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 && "$@"' "$masked" "$@"
