// A kernel timeline without Nsight Systems (the GPU machines have Nsight Compute only, which
// serializes launches): a CUPTI injection library (CUDA_INJECTION64_PATH) that records every
// kernel's GPU start and end, its stream and its graph and node, and writes them as CSV to
// $KTRACE_OUT.<pid>.csv when the process exits. `benches/kernel_timeline.py` reads it.
//
//   cupti=/opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13   # PyTorch's CUPTI
//   gcc -shared -fPIC -O2 -DKVER=10 -I$cupti/include -I/usr/local/cuda/targets/x86_64-linux/include \
//       -o /tmp/ktrace.so benches/kernel_timeline.c $cupti/lib/libcupti.so.13 -Wl,-rpath,$cupti/lib
//   CUDA_INJECTION64_PATH=/tmp/ktrace.so KTRACE_OUT=/tmp/tl bash target/gpu-bundle/run.sh bench ...
//
// KVER: the version of CUPTI's kernel record (`CUpti_ActivityKernel<KVER>`, 10 in CUDA 13.0).
#include <cupti.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define KREC CAT(CUpti_ActivityKernel, KVER)

#define BUF (8 << 20)
static FILE *out;

static void CUPTIAPI requested(uint8_t **buffer, size_t *size, size_t *max) {
  *buffer = (uint8_t *)aligned_alloc(8, BUF);
  *size = BUF;
  *max = 0;
}

static void CUPTIAPI completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                               size_t valid) {
  CUpti_Activity *record = NULL;
  while (cuptiActivityGetNextRecord(buffer, valid, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL ||
        record->kind == CUPTI_ACTIVITY_KIND_KERNEL) {
      KREC *k = (KREC *)record;
      if (out)
        fprintf(out, "%llu,%llu,%u,%u,%llu,%.60s\n", (unsigned long long)k->start,
                (unsigned long long)k->end, k->streamId, k->graphId,
                (unsigned long long)k->graphNodeId, k->name ? k->name : "?");
    }
  }
  free(buffer);
}

static void flush(void) {
  cuptiActivityFlushAll(1);
  if (out) fclose(out);
  out = NULL;
}

int InitializeInjection(void) {
  const char *path = getenv("KTRACE_OUT");
  char name[4096];
  snprintf(name, sizeof name, "%s.%d.csv", path ? path : "ktrace", (int)getpid());
  out = fopen(name, "w");
  if (!out) return 0;
  fprintf(out, "start,end,stream,graph,node,name\n");
  cuptiActivityRegisterCallbacks(requested, completed);
  cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  atexit(flush);
  return 1;
}
