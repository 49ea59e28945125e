/*
 * A fake libnvidia-ml.so.1 for tests: it implements only the NVML entry points that
 * node/nvml.py reaches through pynvml, so the real Python bindings run against a host
 * inventory we control.
 *
 * The inventory is the key=value file named by $FAKE_NVML_CONFIG and is re-read on every
 * call, so a test can change memory use (or lose a GPU) while the code under test runs.
 *
 *   init_error=driver_not_loaded | no_permission | lib_rm_version_mismatch | unknown | <code>
 *   driver=550.54.15
 *   cuda=12040
 *   missing=<nvml function name>[,...]     answers NVML_ERROR_FUNCTION_NOT_FOUND
 *   gpu.<i>.uuid=GPU-...
 *   gpu.<i>.name=NVIDIA A100-SXM4-40GB
 *   gpu.<i>.memory_total_mib=40960
 *   gpu.<i>.memory_used_mib=1024
 *   gpu.<i>.memory_reserved_mib=0         only reported by the _v2 memory call
 *   gpu.<i>.utilization_pct=12
 *   gpu.<i>.compute_capability=8.0
 *   gpu.<i>.processes=<pid>:<used MiB | NA>[,...]
 *   gpu.<i>.not_supported=memory,utilization,compute_capability,processes,name
 *   gpu.<i>.lost=1                         every query of the device answers GPU_IS_LOST
 *   gpu.<i>.handle_error=<name | code>     nvmlDeviceGetHandleByIndex fails
 *
 * MIG (absent mig_mode: the GPU does not support MIG, nvmlDeviceGetMigMode answers
 * NOT_SUPPORTED as on consumer boards):
 *   gpu.<i>.mig_mode=0 | 1                 current mode
 *   gpu.<i>.mig_pending=0 | 1              pending mode (default: the current one)
 *   gpu.<i>.mig_max=7                      nvmlDeviceGetMaxMigDeviceCount
 *   gpu.<i>.not_supported=...,mig_devices  the MIG device count and handles answer NOT_SUPPORTED
 *   gpu.<i>.mig.<j>.uuid=MIG-...           MIG device <j> (an index below mig_max; holes
 *   gpu.<i>.mig.<j>.name=...                 answer NOT_FOUND, as NVML does)
 *   gpu.<i>.mig.<j>.memory_total_mib=4864
 *   gpu.<i>.mig.<j>.memory_used_mib=13
 *   gpu.<i>.mig.<j>.gpu_instance_id=7
 *   gpu.<i>.mig.<j>.compute_instance_id=0
 *   gpu.<i>.mig.<j>.processes=<pid>:<used MiB | NA>[,...]
 *   gpu.<i>.mig.<j>.not_supported=memory,compute_capability,processes,name,uuid
 *   mig_uuid_lookup=0                      nvmlDeviceGetHandleByUUID does not resolve MIG
 *                                          UUIDs (drivers before R470), answers NOT_FOUND
 * A MIG device answers utilization with NOT_SUPPORTED and shares its GPU's compute capability
 * and loss, as on real boards. Its handle is distinct from every GPU handle.
 *
 * The GPU count is one more than the highest <i> seen. A missing or unreadable config
 * file answers NVML_ERROR_UNKNOWN everywhere, so a broken test fixture fails loudly.
 * The inventory of one call lives in thread-local storage: with MIG devices it is too large
 * for the stack of a sampler thread, and each thread reads its own.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
typedef struct fake_device *nvmlDevice_t;

enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

#define MAX_GPUS 64
#define MAX_MIG 8
#define MAX_PROCS 32
#define MIB (1024ULL * 1024ULL)
#define NOT_AVAILABLE_ULL (~0ULL)
/* NVML_STRUCT_VERSION(Memory, 2) as pynvml spells it: nvmlMemory_v2 = 0x02000028. */
#define NVML_MEMORY_V2 0x02000028u

typedef struct {
    unsigned int pid;
    unsigned long long used_bytes;
} fake_proc;

/* What a GPU and a MIG device both answer. */
typedef struct {
    int present;
    char uuid[96];
    char name[96];
    unsigned long long total_mib, used_mib, reserved_mib;
    unsigned int util;
    int cc_major, cc_minor;
    fake_proc procs[MAX_PROCS];
    unsigned int nprocs;
    char not_supported[256];
    unsigned int gi, ci;
} fake_dev;

typedef struct {
    fake_dev d;
    int lost;
    int handle_error;
    int mig_mode;       /* -1: MIG not supported */
    int mig_pending;    /* -1: as mig_mode */
    unsigned int mig_max;
    fake_dev migs[MAX_MIG];
} fake_gpu;

typedef struct {
    int ok;
    int init_error;
    int mig_uuid_lookup;
    char driver[80];
    int cuda;
    char missing[512];
    unsigned int count;
    fake_gpu gpus[MAX_GPUS];
} fake_config;

/* Handles only carry indices; the device state itself is re-read from the file.
 * mig is -1 for a GPU, else the MIG device index on GPU `index`. */
struct fake_device { unsigned int index; int mig; };
static struct fake_device handles[MAX_GPUS];
static struct fake_device mig_handles[MAX_GPUS][MAX_MIG];
static int init_refcount = 0;

static fake_config *this_config(void)
{
    static __thread fake_config config;
    return &config;
}

static int error_code(const char *v)
{
    static const struct { const char *name; int code; } names[] = {
        {"driver_not_loaded", NVML_ERROR_DRIVER_NOT_LOADED},
        {"no_permission", NVML_ERROR_NO_PERMISSION},
        {"lib_rm_version_mismatch", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
        {"gpu_is_lost", NVML_ERROR_GPU_IS_LOST},
        {"not_supported", NVML_ERROR_NOT_SUPPORTED},
        {"unknown", NVML_ERROR_UNKNOWN},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (strcmp(v, names[i].name) == 0)
            return names[i].code;
    int code = atoi(v);
    return code ? code : NVML_ERROR_UNKNOWN;
}

/* True when `item` is one entry of the comma-separated `list`. */
static int in_list(const char *list, const char *item)
{
    size_t n = strlen(item);
    for (const char *p = list; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len == n && strncmp(p, item, n) == 0)
            return 1;
        if (!end)
            break;
        p = end + 1;
    }
    return 0;
}

static void copy_str(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src);
}

static void parse_processes(fake_dev *g, const char *v)
{
    g->nprocs = 0;
    for (const char *p = v; *p && g->nprocs < MAX_PROCS;) {
        unsigned int pid = (unsigned int)strtoul(p, NULL, 10);
        const char *colon = strchr(p, ':');
        const char *end = strchr(p, ',');
        unsigned long long used = NOT_AVAILABLE_ULL;
        if (colon && (!end || colon < end) && strncmp(colon + 1, "NA", 2) != 0)
            used = strtoull(colon + 1, NULL, 10) * MIB;
        g->procs[g->nprocs].pid = pid;
        g->procs[g->nprocs].used_bytes = used;
        g->nprocs++;
        if (!end)
            break;
        p = end + 1;
    }
}

/* Keys a GPU and a MIG device share; returns 0 for a key that is neither's. */
static int set_dev_key(fake_dev *g, const char *key, const char *v)
{
    if (strcmp(key, "uuid") == 0) copy_str(g->uuid, sizeof g->uuid, v);
    else if (strcmp(key, "name") == 0) copy_str(g->name, sizeof g->name, v);
    else if (strcmp(key, "memory_total_mib") == 0) g->total_mib = strtoull(v, NULL, 10);
    else if (strcmp(key, "memory_used_mib") == 0) g->used_mib = strtoull(v, NULL, 10);
    else if (strcmp(key, "memory_reserved_mib") == 0) g->reserved_mib = strtoull(v, NULL, 10);
    else if (strcmp(key, "utilization_pct") == 0) g->util = (unsigned int)atoi(v);
    else if (strcmp(key, "compute_capability") == 0) sscanf(v, "%d.%d", &g->cc_major, &g->cc_minor);
    else if (strcmp(key, "processes") == 0) parse_processes(g, v);
    else if (strcmp(key, "not_supported") == 0) copy_str(g->not_supported, sizeof g->not_supported, v);
    else if (strcmp(key, "gpu_instance_id") == 0) g->gi = (unsigned int)atoi(v);
    else if (strcmp(key, "compute_instance_id") == 0) g->ci = (unsigned int)atoi(v);
    else return 0;
    return 1;
}

static void set_mig_key(fake_gpu *g, unsigned int index, unsigned int j, const char *key,
                        const char *v)
{
    fake_dev *m = &g->migs[j];
    if (!m->present) {
        m->present = 1;
        snprintf(m->uuid, sizeof m->uuid, "MIG-00000000-0000-0000-%04x-%012x", j, index);
        copy_str(m->name, sizeof m->name, "Fake GPU MIG 1g.5gb");
        m->total_mib = 4864;
        m->gi = j + 1;
    }
    set_dev_key(m, key, v);
}

static void set_gpu_key(fake_gpu *g, unsigned int index, const char *key, const char *v)
{
    if (!g->d.present) {
        g->d.present = 1;
        snprintf(g->d.uuid, sizeof g->d.uuid, "GPU-00000000-0000-0000-0000-%012x", index);
        copy_str(g->d.name, sizeof g->d.name, "Fake GPU");
        g->d.total_mib = 16384;
        g->d.cc_major = 8;
        g->mig_mode = -1;
        g->mig_pending = -1;
        g->mig_max = 7;
    }
    unsigned int j;
    int consumed = 0;
    if (sscanf(key, "mig.%u.%n", &j, &consumed) == 1 && consumed > 0) {
        if (j < MAX_MIG)
            set_mig_key(g, index, j, key + consumed, v);
    } else if (set_dev_key(&g->d, key, v)) {
    } else if (strcmp(key, "lost") == 0) g->lost = atoi(v);
    else if (strcmp(key, "handle_error") == 0) g->handle_error = error_code(v);
    else if (strcmp(key, "mig_mode") == 0) g->mig_mode = atoi(v);
    else if (strcmp(key, "mig_pending") == 0) g->mig_pending = atoi(v);
    else if (strcmp(key, "mig_max") == 0) g->mig_max = (unsigned int)atoi(v);
}

static void load(fake_config *c)
{
    memset(c, 0, sizeof *c);
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f)
        return;
    c->ok = 1;
    copy_str(c->driver, sizeof c->driver, "550.54.15");
    c->cuda = 12040;
    c->mig_uuid_lookup = 1;
    char line[1024];
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = '\0';
        char *eq = strchr(line, '=');
        if (line[0] == '#' || !eq)
            continue;
        *eq = '\0';
        const char *key = line, *v = eq + 1;
        unsigned int index;
        int consumed = 0;
        if (sscanf(key, "gpu.%u.%n", &index, &consumed) == 1 && consumed > 0) {
            if (index < MAX_GPUS) {
                set_gpu_key(&c->gpus[index], index, key + consumed, v);
                if (index + 1 > c->count)
                    c->count = index + 1;
            }
        } else if (strcmp(key, "init_error") == 0) {
            c->init_error = error_code(v);
        } else if (strcmp(key, "driver") == 0) {
            copy_str(c->driver, sizeof c->driver, v);
        } else if (strcmp(key, "cuda") == 0) {
            c->cuda = atoi(v);
        } else if (strcmp(key, "mig_uuid_lookup") == 0) {
            c->mig_uuid_lookup = atoi(v);
        } else if (strcmp(key, "missing") == 0) {
            copy_str(c->missing, sizeof c->missing, v);
        }
    }
    fclose(f);
}

/* Common preamble of every call: fresh inventory, library state, simulated symbol loss. */
static nvmlReturn_t enter(fake_config *c, const char *fn)
{
    load(c);
    if (!c->ok)
        return NVML_ERROR_UNKNOWN;
    if (in_list(c->missing, fn))
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    if (init_refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    return NVML_SUCCESS;
}

static int is_gpu_handle(nvmlDevice_t h)
{
    return h >= handles && h < handles + MAX_GPUS;
}

static int is_mig_handle(nvmlDevice_t h)
{
    return h >= &mig_handles[0][0] && h < &mig_handles[0][0] + MAX_GPUS * MAX_MIG;
}

/* The GPU a handle (of a GPU or of one of its MIG devices) belongs to, or NULL. */
static fake_gpu *owner(fake_config *c, nvmlDevice_t h)
{
    if (!h || !(is_gpu_handle(h) || is_mig_handle(h)) || h->index >= c->count)
        return NULL;
    fake_gpu *g = &c->gpus[h->index];
    if (!g->d.present)
        return NULL;
    if (h->mig >= 0 && (h->mig >= MAX_MIG || !g->migs[h->mig].present || g->mig_mode != 1))
        return NULL;
    return g;
}

/* Resolves a handle for a device query; `field` names what not_supported may switch off.
 * A MIG handle resolves to its MIG device; `gpu` (may be NULL) gets the GPU either way. */
static nvmlReturn_t device_of(fake_config *c, const char *fn, nvmlDevice_t h, const char *field,
                              fake_dev **out, fake_gpu **gpu)
{
    nvmlReturn_t r = enter(c, fn);
    if (r != NVML_SUCCESS)
        return r;
    fake_gpu *g = owner(c, h);
    if (!g)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->lost)
        return NVML_ERROR_GPU_IS_LOST;
    fake_dev *d = h->mig >= 0 ? &g->migs[h->mig] : &g->d;
    if (field && in_list(d->not_supported, field))
        return NVML_ERROR_NOT_SUPPORTED;
    *out = d;
    if (gpu)
        *gpu = g;
    return NVML_SUCCESS;
}

static nvmlReturn_t device(fake_config *c, const char *fn, nvmlDevice_t h, const char *field,
                           fake_dev **out)
{
    return device_of(c, fn, h, field, out, NULL);
}

static nvmlReturn_t do_init(void)
{
    fake_config *c = this_config();
    load(c);
    if (!c->ok)
        return NVML_ERROR_UNKNOWN;
    if (c->init_error)
        return c->init_error;
    init_refcount++;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
nvmlReturn_t nvmlInit(void) { return do_init(); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return do_init(); }

nvmlReturn_t nvmlShutdown(void)
{
    if (init_refcount <= 0)
        return NVML_ERROR_UNINITIALIZED;
    init_refcount--;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t r)
{
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
    fake_config *c = this_config();
    nvmlReturn_t r = enter(c, "nvmlSystemGetDriverVersion");
    if (r != NVML_SUCCESS)
        return r;
    if (strlen(c->driver) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    copy_str(version, length, c->driver);
    return NVML_SUCCESS;
}

static nvmlReturn_t cuda_version(const char *fn, int *v)
{
    fake_config *c = this_config();
    nvmlReturn_t r = enter(c, fn);
    if (r != NVML_SUCCESS)
        return r;
    *v = c->cuda;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion", v);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v)
{
    return cuda_version("nvmlSystemGetCudaDriverVersion_v2", v);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count)
{
    fake_config *c = this_config();
    nvmlReturn_t r = enter(c, "nvmlDeviceGetCount_v2");
    if (r != NVML_SUCCESS)
        return r;
    *count = c->count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *out)
{
    fake_config *c = this_config();
    nvmlReturn_t r = enter(c, "nvmlDeviceGetHandleByIndex_v2");
    if (r != NVML_SUCCESS)
        return r;
    if (index >= c->count || !c->gpus[index].d.present)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (c->gpus[index].handle_error)
        return c->gpus[index].handle_error;
    handles[index].index = index;
    handles[index].mig = -1;
    *out = &handles[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *out)
{
    fake_config *c = this_config();
    nvmlReturn_t r = enter(c, "nvmlDeviceGetHandleByUUID");
    if (r != NVML_SUCCESS)
        return r;
    for (unsigned int i = 0; i < c->count; i++) {
        fake_gpu *g = &c->gpus[i];
        if (g->d.present && strcmp(g->d.uuid, uuid) == 0) {
            handles[i].index = i;
            handles[i].mig = -1;
            *out = &handles[i];
            return NVML_SUCCESS;
        }
        /* R470+ drivers resolve MIG UUIDs too, to the MIG device's own handle. */
        for (int j = 0; c->mig_uuid_lookup && g->mig_mode == 1 && j < MAX_MIG; j++) {
            if (g->migs[j].present && strcmp(g->migs[j].uuid, uuid) == 0) {
                mig_handles[i][j].index = i;
                mig_handles[i][j].mig = j;
                *out = &mig_handles[i][j];
                return NVML_SUCCESS;
            }
        }
    }
    return NVML_ERROR_NOT_FOUND;
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t h, unsigned int *index)
{
    fake_config *c = this_config();
    fake_dev *g;
    nvmlReturn_t r = device(c, "nvmlDeviceGetIndex", h, NULL, &g);
    if (r == NVML_SUCCESS && h->mig >= 0)
        return NVML_ERROR_INVALID_ARGUMENT;  /* NVML has no index for a MIG device handle */
    if (r == NVML_SUCCESS)
        *index = h->index;
    return r;
}

static nvmlReturn_t copy_out(const char *src, char *dst, unsigned int length)
{
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    copy_str(dst, length, src);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t h, char *uuid, unsigned int length)
{
    fake_config *c = this_config();
    fake_dev *g;
    nvmlReturn_t r = device(c, "nvmlDeviceGetUUID", h, "uuid", &g);
    return r == NVML_SUCCESS ? copy_out(g->uuid, uuid, length) : r;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t h, char *name, unsigned int length)
{
    fake_config *c = this_config();
    fake_dev *g;
    nvmlReturn_t r = device(c, "nvmlDeviceGetName", h, "name", &g);
    return r == NVML_SUCCESS ? copy_out(g->name, name, length) : r;
}

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} nvmlMemory_v2_t;

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t h, nvmlMemory_t *m)
{
    fake_config *c = this_config();
    fake_dev *g;
    nvmlReturn_t r = device(c, "nvmlDeviceGetMemoryInfo", h, "memory", &g);
    if (r != NVML_SUCCESS)
        return r;
    /* v1 folds driver-reserved memory into "used", as real drivers do. */
    unsigned long long used = (g->used_mib + g->reserved_mib) * MIB;
    m->total = g->total_mib * MIB;
    m->used = used;
    m->free = m->total > used ? m->total - used : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t h, nvmlMemory_v2_t *m)
{
    fake_config *c = this_config();
    fake_dev *g;
    nvmlReturn_t r = device(c, "nvmlDeviceGetMemoryInfo_v2", h, "memory", &g);
    if (r != NVML_SUCCESS)
        return r;
    if (m->version != NVML_MEMORY_V2)
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    m->total = g->total_mib * MIB;
    m->reserved = g->reserved_mib * MIB;
    m->used = g->used_mib * MIB;
    unsigned long long taken = m->used + m->reserved;
    m->free = m->total > taken ? m->total - taken : 0;
    return NVML_SUCCESS;
}

typedef struct { unsigned int gpu, memory; } nvmlUtilization_t;

nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t h, nvmlUtilization_t *u)
{
    fake_config *c = this_config();
    fake_dev *g;
    nvmlReturn_t r = device(c, "nvmlDeviceGetUtilizationRates", h, "utilization", &g);
    if (r != NVML_SUCCESS)
        return r;
    if (h->mig >= 0)
        return NVML_ERROR_NOT_SUPPORTED;  /* as on real boards: no utilization per MIG device */
    u->gpu = g->util;
    u->memory = 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t h, int *major, int *minor)
{
    fake_config *c = this_config();
    fake_dev *g;
    fake_gpu *gpu;
    nvmlReturn_t r = device_of(c, "nvmlDeviceGetCudaComputeCapability", h, "compute_capability",
                               &g, &gpu);
    if (r != NVML_SUCCESS)
        return r;
    *major = gpu->d.cc_major;
    *minor = gpu->d.cc_minor;
    return NVML_SUCCESS;
}

/* Layout of nvmlProcessInfo_v2_t, which pynvml also uses for the _v3 call. */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

static nvmlReturn_t processes(const char *fn, nvmlDevice_t h, unsigned int *count,
                              nvmlProcessInfo_t *infos)
{
    fake_config *c = this_config();
    fake_dev *g;
    nvmlReturn_t r = device(c, fn, h, "processes", &g);
    if (r != NVML_SUCCESS)
        return r;
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* NVML's two-call protocol: report the size first, fill only a large enough array. */
    if (*count < g->nprocs || (!infos && g->nprocs > 0)) {
        *count = g->nprocs;
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    for (unsigned int i = 0; i < g->nprocs; i++) {
        infos[i].pid = g->procs[i].pid;
        infos[i].usedGpuMemory = g->procs[i].used_bytes;
        infos[i].gpuInstanceId = h->mig >= 0 ? g->gi : 0xFFFFFFFFu;
        infos[i].computeInstanceId = h->mig >= 0 ? g->ci : 0xFFFFFFFFu;
    }
    *count = g->nprocs;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t h, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    return processes("nvmlDeviceGetComputeRunningProcesses_v3", h, count, infos);
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t h, unsigned int *count,
                                                     nvmlProcessInfo_t *infos)
{
    return processes("nvmlDeviceGetComputeRunningProcesses_v2", h, count, infos);
}

/* --- MIG ---------------------------------------------------------------------------------- */

/* A GPU handle (not a MIG one) for a MIG query on the GPU itself. */
static nvmlReturn_t gpu_only(fake_config *c, const char *fn, nvmlDevice_t h, fake_gpu **out)
{
    fake_dev *d;
    nvmlReturn_t r = device_of(c, fn, h, NULL, &d, out);
    if (r != NVML_SUCCESS)
        return r;
    if (h->mig >= 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t h, unsigned int *current, unsigned int *pending)
{
    fake_config *c = this_config();
    fake_gpu *g;
    nvmlReturn_t r = gpu_only(c, "nvmlDeviceGetMigMode", h, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (g->mig_mode < 0 || in_list(g->d.not_supported, "mig"))
        return NVML_ERROR_NOT_SUPPORTED;
    *current = (unsigned int)g->mig_mode;
    *pending = (unsigned int)(g->mig_pending < 0 ? g->mig_mode : g->mig_pending);
    return NVML_SUCCESS;
}

/* A GPU in MIG mode whose MIG devices may be listed. */
static nvmlReturn_t mig_parent(fake_config *c, const char *fn, nvmlDevice_t h, fake_gpu **out)
{
    nvmlReturn_t r = gpu_only(c, fn, h, out);
    if (r != NVML_SUCCESS)
        return r;
    if ((*out)->mig_mode < 0 || in_list((*out)->d.not_supported, "mig_devices"))
        return NVML_ERROR_NOT_SUPPORTED;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t h, unsigned int *count)
{
    fake_config *c = this_config();
    fake_gpu *g;
    nvmlReturn_t r = mig_parent(c, "nvmlDeviceGetMaxMigDeviceCount", h, &g);
    if (r != NVML_SUCCESS)
        return r;
    *count = g->mig_max;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t h, unsigned int index,
                                                 nvmlDevice_t *out)
{
    fake_config *c = this_config();
    fake_gpu *g;
    nvmlReturn_t r = mig_parent(c, "nvmlDeviceGetMigDeviceHandleByIndex", h, &g);
    if (r != NVML_SUCCESS)
        return r;
    if (index >= g->mig_max || index >= MAX_MIG)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (g->mig_mode != 1 || !g->migs[index].present)
        return NVML_ERROR_NOT_FOUND;
    mig_handles[h->index][index].index = h->index;
    mig_handles[h->index][index].mig = (int)index;
    *out = &mig_handles[h->index][index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t h, unsigned int *is_mig)
{
    fake_config *c = this_config();
    fake_dev *d;
    nvmlReturn_t r = device(c, "nvmlDeviceIsMigDeviceHandle", h, NULL, &d);
    if (r == NVML_SUCCESS)
        *is_mig = h->mig >= 0;
    return r;
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t h, nvmlDevice_t *out)
{
    fake_config *c = this_config();
    fake_dev *d;
    nvmlReturn_t r = device(c, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", h, NULL, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (h->mig < 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    handles[h->index].index = h->index;
    handles[h->index].mig = -1;
    *out = &handles[h->index];
    return NVML_SUCCESS;
}

static nvmlReturn_t instance_id(const char *fn, nvmlDevice_t h, int compute, unsigned int *id)
{
    fake_config *c = this_config();
    fake_dev *d;
    nvmlReturn_t r = device(c, fn, h, NULL, &d);
    if (r != NVML_SUCCESS)
        return r;
    if (h->mig < 0)
        return NVML_ERROR_INVALID_ARGUMENT;  /* only MIG device handles have instance ids */
    *id = compute ? d->ci : d->gi;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t h, unsigned int *id)
{
    return instance_id("nvmlDeviceGetGpuInstanceId", h, 0, id);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t h, unsigned int *id)
{
    return instance_id("nvmlDeviceGetComputeInstanceId", h, 1, id);
}
