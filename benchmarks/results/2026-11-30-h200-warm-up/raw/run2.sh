for tree in old new; do root=$PWD; [ $tree = old ] && root=$PWD/.carry/old/semkv
  for r in 1 2; do echo "== window kernels $tree $r"; PYTHONPATH=$root python3 benchmarks/kernel_check.py --window-only 2>&1 | grep -v Warning | tail -4; done
done
METHODS="chunkkv:neighbours=3" bash .carry/watch/run.sh
