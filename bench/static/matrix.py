"""What the report compiles unless told otherwise: the targets, the operand types, D, the batches (whose launch
plans give the waves) and the public calls."""

TARGETS = (90, 80, 100)
DIM = 512
BATCHES = (16384, 32768, 65536)
# (dtype, precision): bf16 always; fp32 with tf32 products on request (--tf32).
BF16, TF32 = ("bfloat16", "ieee"), ("float32", "tf32")
ENTRIES = ("cal_inf_loss", "cal_siglip_loss")
