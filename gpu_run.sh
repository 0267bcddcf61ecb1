python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
mkdir -p /tmp/b
for m in make_rmsnorm make_conv1d; do timeout 120 python3 -m torch_kernelize.fill_cache --model benchmarks/workloads.py:$m --target cuda --cache-dir /tmp/kc --budget 3 > /tmp/b/fill_$m.log 2>&1; done
for w in rmsnorm_4096x8192_fp16 conv1d_B2048_C96_L200_k3_fp16; do
  python3 benchmarks/host_profile.py $w --cache-dir /tmp/kc --first-call > /dev/null 2>&1
  python3 benchmarks/host_profile.py $w --cache-dir /tmp/kc --first-call --top 70 > /tmp/b/first_$w.log 2>&1
done
