// Programmatic dependent launches (sm_90+). DEPENDENT (set by the host with -D; 0 when absent):
// the kernel is launched with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, so its CTAs
// may start while the previous kernel on the stream drains. PS_AWAIT_PREVIOUS_KERNEL must then run
// before the kernel's first memory access: it waits until every earlier kernel has finished and
// its writes are visible, then lets the next kernel launch (which waits the same way).
#ifndef DEPENDENT
#define DEPENDENT 0
#endif

#if DEPENDENT && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PS_AWAIT_PREVIOUS_KERNEL()                               \
    do {                                                         \
        asm volatile("griddepcontrol.wait;" ::: "memory");       \
        asm volatile("griddepcontrol.launch_dependents;" :::);   \
    } while (0)
#else
#define PS_AWAIT_PREVIOUS_KERNEL() do {} while (0)
#endif
