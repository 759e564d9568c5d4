"""The standard request through OpenVINO GenAI's VLMPipeline: warm-up, then one measured request; JSON like
`python -m engine ask --json` (ttft_s, decode_tokens_per_s, e2e_s, output_tokens, rss_peak_bytes)."""
import json, resource, sys, time
import numpy as np
import openvino as ov
import openvino_genai as ovg
from PIL import Image
model_dir, image_path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
hint = sys.argv[4] if len(sys.argv) > 4 else "f32"
props = {"INFERENCE_NUM_THREADS": threads, "INFERENCE_PRECISION_HINT": hint}
started = time.perf_counter()
pipe = ovg.VLMPipeline(model_dir, "CPU", **props)
load_s = time.perf_counter() - started
picture = Image.open(image_path).convert("RGB")
image = ov.Tensor(np.array(picture, dtype=np.uint8)[None])
config = ovg.GenerationConfig()
config.max_new_tokens = 64
config.ignore_eos = True
config.do_sample = False

def ask(image):
    times = []
    def stream(text):
        times.append(time.perf_counter())
        return ovg.StreamingStatus.RUNNING
    begin = time.perf_counter()
    result = pipe.generate("Describe this image.", images=[image], generation_config=config, streamer=stream)
    end = time.perf_counter()
    metrics = result.perf_metrics
    out = metrics.get_num_generated_tokens()
    return {"ttft_s": metrics.get_ttft().mean / 1000, "ttft_stream_s": times[0] - begin if times else None,
            "decode_tokens_per_s": 1000 / metrics.get_tpot().mean, "e2e_s": end - begin, "output_tokens": out,
            "load_s": load_s, "threads": threads, "hint": hint}

# Warm-up on the picture upside down: VLMPipeline keeps the last request's KV cache and reuses it for an identical
# one (same picture and text: 0.18 s of prefill instead of 1.5 s), so the measured request must differ from it.
ask(ov.Tensor(np.ascontiguousarray(np.array(picture, dtype=np.uint8)[::-1])[None]))
record = ask(image)
record["rss_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps(record))
