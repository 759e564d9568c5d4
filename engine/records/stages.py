"""The names of a request's stages and statuses, owned here and imported by every page, chart, exporter and engine."""

# Stage names in the order a request meets them. Every stage is timed apart; their sum never exceeds e2e_s.
LOAD_IMAGES = "load_images"
RENDER_PAGES = "render_pages"  # a document's pages rasterized (PDFium), apart from load_images
VIDEO_PROBE = "video_probe"  # a clip's container read and checked, its frames planned: nothing decoded yet
FRAME_DECODE = "frame_decode"  # a clip's sampled frames sought, decoded and resized
UPLOAD = "upload"  # remote engine: sending the request until the server's response begins
OCR_ENHANCE = "ocr_enhance"
PREPROCESS = "preprocess"
VISION_ENCODE = "vision_encode"
PREFILL = "prefill"
SERVER_FIRST_TOKEN = "server_first_token"  # remote engine: the server's vision, prefill and first token, as seen
DECODE = "decode"
DETOKENIZE = "detokenize"
GRAMMAR = "grammar"  # a structured answer's grammar: compiled at submit, then each token's mask
STAGES = (LOAD_IMAGES, RENDER_PAGES, VIDEO_PROBE, FRAME_DECODE, UPLOAD, OCR_ENHANCE, PREPROCESS, VISION_ENCODE, PREFILL, SERVER_FIRST_TOKEN, DECODE,
          DETOKENIZE, GRAMMAR)
QUEUE_WAIT = "queue_wait"  # not a stage of the record's `stages`: its own field, shown beside them in charts

# ok; cancelled (by the caller); error; refused (bad input, busy, too long or too big, before any model compute);
# running: written when the worker starts, replaced when it ends; interrupted: a running record whose server
# process died (found and relabelled at the next start); replica_lost: a cluster replica's running record whose
# replica died (relabelled by the cluster's front, scale/records.py).
OK, CANCELLED, ERROR, REFUSED, RUNNING, INTERRUPTED = "ok", "cancelled", "error", "refused", "running", "interrupted"
REPLICA_LOST = "replica_lost"
STATUSES = (OK, CANCELLED, ERROR, REFUSED, RUNNING, INTERRUPTED, REPLICA_LOST)
