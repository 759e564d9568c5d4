# The standard request (448x448, "Describe this image.", 64 new tokens, greedy, 2 threads, warm process), one
# process per request: vlscope int8 (`python -m engine ask`) and OpenVINO GenAI int8 (openvino_ask.py) in turn,
# A B then B A per pair. usage: bash bench/peers/against_openvino.sh OV_MODEL_DIR IMAGE OV_PYTHON PAIRS OUT_DIR   (run from the repo root)
ov_model=$1; image=$2; ov_python=$3; pairs=$4; out=$5
here=$(dirname "$0")
mkdir -p "$out"
for pair in $(seq 1 "$pairs"); do
  order="vlscope openvino"; [ $((pair % 2)) = 0 ] && order="openvino vlscope"
  for side in $order; do
    if [ $side = vlscope ]; then
      python -m engine ask --model models/qwen3-vl-2b-skeleton --image "$image" --prompt "Describe this image." --dtype int8 --threads 2 \
        --max-new-tokens 64 --db "$out/vlscope.sqlite" --json 2>/dev/null > "$out/$side-$pair.json"
    else
      "$ov_python" "$here/openvino_ask.py" "$ov_model" "$image" 2 f32 2>/dev/null > "$out/$side-$pair.json"
    fi
    python -c "import json; m=json.load(open('$out/$side-$pair.json')); print('| $pair | $side | %.2f | %.2f | %.2f | %d | %.2f |' % (m['ttft_s'], m['decode_tokens_per_s'], m['e2e_s'], m['output_tokens'], m['rss_peak_bytes']/1e9))"
  done
done
