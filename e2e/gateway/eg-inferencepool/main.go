// Command inferencepool is an Envoy Gateway extension server that gives an HTTPRoute's InferencePool
// backend (inference.networking.k8s.io/v1) what the Gateway API Inference Extension asks of a gateway:
// the pool's endpoint picker consulted over ext_proc, and the request sent where the picker says.
//
// Envoy Gateway renders an InferencePool backendRef as a custom backend and asks its extension for the
// rest (Envoy AI Gateway does this in production; its module is not served here). This one:
//
//   - PostClusterModify: the pool's cluster becomes ORIGINAL_DST on the picker's
//     x-gateway-destination-endpoint header, and carries the pool's picker in its metadata;
//   - PostTranslateModify: for each pool, a cluster for its picker (its Service's name, HTTP/2, TLS
//     without verification, as pickers serve it), and an ext_proc filter in every HTTP listener,
//     disabled but where a route (or a weighted cluster) sends to that pool; there the response
//     names the upstream that served (x-gateway-destination-endpoint-served), which a
//     header_to_metadata filter turns into the envoy.lb metadata the picker is forwarded;
//   - a loop writes each pool's status.parents: the Gateways whose accepted HTTPRoutes name it, with
//     Accepted, and ResolvedRefs False when its picker's Service does not exist;
//   - a rule naming several pools (one cluster in Envoy Gateway) gets a cluster
//     per pool, and its route one route per pool, each matching its weight's share of the requests,
//     so each pool's picker picks its share.
//
// It is test infrastructure for the local cluster (e2e/gateway/envoy_gateway.py), built against the
// Envoy Gateway release the cluster runs.
//
// Every pool fails closed, whatever its failureMode: failing open needs the pool's endpoints to fall
// back to, and this cluster has none (ORIGINAL_DST on the picker's header: without the header it has
// no host, and Envoy answers 503). Envoy AI Gateway's extension also runs every pool's picker with
// failure_mode_allow false.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"net"
	"sort"
	"strings"
	"time"

	"github.com/envoyproxy/gateway/proto/extension"
	clusterv3 "github.com/envoyproxy/go-control-plane/envoy/config/cluster/v3"
	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	endpointv3 "github.com/envoyproxy/go-control-plane/envoy/config/endpoint/v3"
	listenerv3 "github.com/envoyproxy/go-control-plane/envoy/config/listener/v3"
	routev3 "github.com/envoyproxy/go-control-plane/envoy/config/route/v3"
	extprocv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/ext_proc/v3"
	h2mv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/http/header_to_metadata/v3"
	hcmv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/filters/network/http_connection_manager/v3"
	tlsv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/transport_sockets/tls/v3"
	httpv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/upstreams/http/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/structpb"
)

const (
	poolMetadata      = "routerfleet.dev/inferencepool"  // on a pool's cluster: its picker
	splitMetadata     = "routerfleet.dev/inferencepools" // a rule's several pools, with their weights
	destinationHeader = "x-gateway-destination-endpoint"
	servedHeader      = "x-gateway-destination-endpoint-served"
	lbNamespace       = "envoy.lb"
	servedFilter      = "envoy.filters.http.header_to_metadata/inferencepool/served"
	hcmName           = "envoy.filters.network.http_connection_manager"
	extProcPrefix     = "envoy.filters.http.ext_proc/inferencepool/"
	pickerPrefix      = "inferencepool/picker/"
)

// pool is what the extension needs of an InferencePool: where its picker is.
type pool struct {
	Namespace string
	Name      string
	Picker    string // the picker's Service
	Port      uint32
}

func (p pool) key() string        { return p.Namespace + "/" + p.Name }
func (p pool) filterName() string { return extProcPrefix + p.key() }
func (p pool) clusterName() string {
	return pickerPrefix + p.key()
}
func (p pool) host() string { return fmt.Sprintf("%s.%s.svc.cluster.local", p.Picker, p.Namespace) }

// poolFrom reads an InferencePool as Envoy Gateway hands it over (the object's JSON).
func poolFrom(raw []byte) (pool, bool) {
	var obj struct {
		Kind     string `json:"kind"`
		Metadata struct {
			Name      string `json:"name"`
			Namespace string `json:"namespace"`
		} `json:"metadata"`
		Spec struct {
			EndpointPickerRef struct {
				Name string `json:"name"`
				Port struct {
					Number uint32 `json:"number"`
				} `json:"port"`
			} `json:"endpointPickerRef"`
		} `json:"spec"`
	}
	if err := json.Unmarshal(raw, &obj); err != nil || obj.Kind != "InferencePool" {
		return pool{}, false
	}
	ref := obj.Spec.EndpointPickerRef
	port := ref.Port.Number
	if port == 0 {
		port = 9002 // the protocol's default picker port
	}
	return pool{obj.Metadata.Namespace, obj.Metadata.Name, ref.Name, port}, true
}

func (p pool) metadata() *structpb.Struct {
	s, _ := structpb.NewStruct(map[string]any{
		"namespace": p.Namespace, "name": p.Name, "picker": p.Picker, "port": float64(p.Port),
	})
	return s
}

func poolOfCluster(c *clusterv3.Cluster) (pool, bool) {
	md := c.GetMetadata().GetFilterMetadata()[poolMetadata]
	if md == nil {
		return pool{}, false
	}
	f := md.GetFields()
	return pool{
		Namespace: f["namespace"].GetStringValue(),
		Name:      f["name"].GetStringValue(),
		Picker:    f["picker"].GetStringValue(),
		Port:      uint32(f["port"].GetNumberValue()),
	}, true
}

type server struct {
	extension.UnimplementedEnvoyGatewayExtensionServer
}

func (server) PostClusterModify(_ context.Context, req *extension.PostClusterModifyRequest) (*extension.PostClusterModifyResponse, error) {
	c := req.GetCluster()
	var found []pool
	for _, r := range req.GetPostClusterContext().GetBackendExtensionResources() {
		if p, ok := poolFrom(r.GetUnstructuredBytes()); ok {
			found = append(found, p)
		}
	}
	if len(found) > 0 {
		// A rule's backendRefs are one cluster here (httproute/<ns>/<name>/rule/<i>): the pools' weights
		// are the rule's, read from its HTTPRoute.
		var split []any
		if len(found) > 1 {
			weights := ruleWeights(c.GetName(), found)
			for i, p := range found {
				split = append(split, map[string]any{"pool": p.metadata().AsMap(), "weight": float64(weights[i])})
			}
		}
		p := found[0]
		c.ClusterDiscoveryType = &clusterv3.Cluster_Type{Type: clusterv3.Cluster_ORIGINAL_DST}
		c.LbPolicy = clusterv3.Cluster_CLUSTER_PROVIDED
		c.LbConfig = &clusterv3.Cluster_OriginalDstLbConfig_{OriginalDstLbConfig: &clusterv3.Cluster_OriginalDstLbConfig{
			UseHttpHeader: true, HttpHeaderName: destinationHeader,
		}}
		c.EdsClusterConfig = nil
		c.LoadAssignment = nil
		c.LoadBalancingPolicy = nil
		c.ConnectTimeout = durationpb.New(10 * time.Second)
		if c.Metadata == nil {
			c.Metadata = &corev3.Metadata{}
		}
		if c.Metadata.FilterMetadata == nil {
			c.Metadata.FilterMetadata = map[string]*structpb.Struct{}
		}
		c.Metadata.FilterMetadata[poolMetadata] = p.metadata()
		if len(found) > 1 {
			md, err := structpb.NewStruct(map[string]any{"pools": split})
			if err != nil {
				return nil, err
			}
			c.Metadata.FilterMetadata[splitMetadata] = md
		}
	}
	return &extension.PostClusterModifyResponse{Cluster: c}, nil
}

func (server) PostTranslateModify(_ context.Context, req *extension.PostTranslateModifyRequest) (*extension.PostTranslateModifyResponse, error) {
	clusters, splits := splitClusters(req.GetClusters())
	pools := map[string]pool{} // cluster name -> its pool
	for _, c := range clusters {
		if p, ok := poolOfCluster(c); ok {
			pools[c.GetName()] = p
		}
	}
	resp := &extension.PostTranslateModifyResponse{
		Clusters: clusters, Secrets: req.GetSecrets(), Listeners: req.GetListeners(), Routes: req.GetRoutes(),
	}
	for _, rc := range resp.Routes {
		splitRoutes(rc, splits)
	}
	if len(pools) == 0 {
		return resp, nil
	}
	distinct := map[string]pool{}
	for _, p := range pools {
		distinct[p.key()] = p
	}
	keys := make([]string, 0, len(distinct))
	for k := range distinct {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	ordered := make([]pool, 0, len(keys))
	for _, k := range keys {
		ordered = append(ordered, distinct[k])
	}
	for _, p := range ordered {
		c, err := pickerCluster(p)
		if err != nil {
			return nil, err
		}
		resp.Clusters = append(resp.Clusters, c)
	}
	for _, l := range resp.Listeners {
		if err := addFilters(l, ordered); err != nil {
			return nil, err
		}
	}
	for _, rc := range resp.Routes {
		if err := enableOnRoutes(rc, pools); err != nil {
			return nil, err
		}
	}
	return resp, nil
}

// pickerCluster: the picker's Service by name (the cluster DNS answers its ClusterIP), gRPC over
// HTTP/2 and TLS without verification, as pickers serve it (a self-signed certificate by default).
type share struct {
	cluster string
	weight  uint32
}

// splitClusters gives each pool of a rule naming several its own cluster (a copy of the rule's, named
// <cluster>/pool/<i>), so each pool has its own picker. Returns the clusters and, per split cluster,
// its pools' clusters with their weights.
func splitClusters(in []*clusterv3.Cluster) ([]*clusterv3.Cluster, map[string][]share) {
	out := append([]*clusterv3.Cluster{}, in...)
	splits := map[string][]share{}
	for _, c := range in {
		md := c.GetMetadata().GetFilterMetadata()[splitMetadata]
		if md == nil {
			continue
		}
		for i, v := range md.GetFields()["pools"].GetListValue().GetValues() {
			f := v.GetStructValue().GetFields()
			one := proto.Clone(c).(*clusterv3.Cluster)
			one.Name = fmt.Sprintf("%s/pool/%d", c.GetName(), i)
			one.Metadata.FilterMetadata[poolMetadata] = f["pool"].GetStructValue()
			delete(one.Metadata.FilterMetadata, splitMetadata)
			out = append(out, one)
			splits[c.GetName()] = append(splits[c.GetName()], share{one.Name, uint32(f["weight"].GetNumberValue())})
		}
	}
	return out, splits
}

// splitRoutes turns a route to a split cluster into one route per pool, matching the same requests
// with the pool's share of the weight left (the last one takes the rest): a pool's picker is enabled
// per route, which Envoy does not do per weighted cluster.
func splitRoutes(rc *routev3.RouteConfiguration, splits map[string][]share) {
	for _, vh := range rc.GetVirtualHosts() {
		var routes []*routev3.Route
		for _, r := range vh.GetRoutes() {
			shares, ok := splits[r.GetRoute().GetCluster()]
			if !ok {
				routes = append(routes, r)
				continue
			}
			left := uint32(0)
			for _, s := range shares {
				left += s.weight
			}
			for i, s := range shares {
				one := proto.Clone(r).(*routev3.Route)
				one.Name = fmt.Sprintf("%s/pool/%d", r.GetName(), i)
				one.GetRoute().ClusterSpecifier = &routev3.RouteAction_Cluster{Cluster: s.cluster}
				if i < len(shares)-1 && left > 0 {
					one.Match.RuntimeFraction = &corev3.RuntimeFractionalPercent{
						DefaultValue: &typev3.FractionalPercent{
							Numerator:   uint32(uint64(s.weight) * 1_000_000 / uint64(left)),
							Denominator: typev3.FractionalPercent_MILLION,
						},
						RuntimeKey: "routerfleet.inferencepool." + one.Name,
					}
				}
				left -= s.weight
				routes = append(routes, one)
			}
		}
		vh.Routes = routes
	}
}

func pickerCluster(p pool) (*clusterv3.Cluster, error) {
	tls, err := anypb.New(&tlsv3.UpstreamTlsContext{
		Sni:              p.host(),
		CommonTlsContext: &tlsv3.CommonTlsContext{AlpnProtocols: []string{"h2"}},
	})
	if err != nil {
		return nil, err
	}
	h2, err := anypb.New(&httpv3.HttpProtocolOptions{
		UpstreamProtocolOptions: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_{
			ExplicitHttpConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig{
				ProtocolConfig: &httpv3.HttpProtocolOptions_ExplicitHttpConfig_Http2ProtocolOptions{
					Http2ProtocolOptions: &corev3.Http2ProtocolOptions{},
				},
			},
		},
	})
	if err != nil {
		return nil, err
	}
	address := &corev3.Address{Address: &corev3.Address_SocketAddress{SocketAddress: &corev3.SocketAddress{
		Address: p.host(), PortSpecifier: &corev3.SocketAddress_PortValue{PortValue: p.Port},
	}}}
	return &clusterv3.Cluster{
		Name:                 p.clusterName(),
		ClusterDiscoveryType: &clusterv3.Cluster_Type{Type: clusterv3.Cluster_STRICT_DNS},
		ConnectTimeout:       durationpb.New(2 * time.Second),
		DnsRefreshRate:       durationpb.New(2 * time.Second),
		LoadAssignment: &endpointv3.ClusterLoadAssignment{
			ClusterName: p.clusterName(),
			Endpoints: []*endpointv3.LocalityLbEndpoints{{LbEndpoints: []*endpointv3.LbEndpoint{{
				HostIdentifier: &endpointv3.LbEndpoint_Endpoint{Endpoint: &endpointv3.Endpoint{Address: address}},
			}}}},
		},
		TransportSocket: &corev3.TransportSocket{
			Name: "envoy.transport_sockets.tls", ConfigType: &corev3.TransportSocket_TypedConfig{TypedConfig: tls},
		},
		TypedExtensionProtocolOptions: map[string]*anypb.Any{"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": h2},
	}, nil
}

// extProc: the pool's picker as an ext_proc filter, bodies FULL_DUPLEX_STREAMED both ways (the
// protocol's mode), the served endpoint reported back (upstream.address).
func extProc(p pool) (*hcmv3.HttpFilter, error) {
	cfg, err := anypb.New(&extprocv3.ExternalProcessor{
		GrpcService: &corev3.GrpcService{
			TargetSpecifier: &corev3.GrpcService_EnvoyGrpc_{EnvoyGrpc: &corev3.GrpcService_EnvoyGrpc{
				ClusterName: p.clusterName(), Authority: fmt.Sprintf("%s:%d", p.host(), p.Port),
			}},
			Timeout: durationpb.New(10 * time.Second),
		},
		FailureModeAllow:   false, // fails closed: see the package comment
		MessageTimeout:     durationpb.New(10 * time.Second),
		ResponseAttributes: []string{"upstream.address"},
		MetadataOptions: &extprocv3.MetadataOptions{
			ForwardingNamespaces: &extprocv3.MetadataOptions_MetadataNamespaces{Untyped: []string{"envoy.lb.subset_hint", lbNamespace}},
		},
		ProcessingMode: &extprocv3.ProcessingMode{
			RequestHeaderMode:   extprocv3.ProcessingMode_SEND,
			ResponseHeaderMode:  extprocv3.ProcessingMode_SEND,
			RequestBodyMode:     extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			ResponseBodyMode:    extprocv3.ProcessingMode_FULL_DUPLEX_STREAMED,
			RequestTrailerMode:  extprocv3.ProcessingMode_SEND,
			ResponseTrailerMode: extprocv3.ProcessingMode_SEND,
		},
	})
	if err != nil {
		return nil, err
	}
	return &hcmv3.HttpFilter{Name: p.filterName(), Disabled: true, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: cfg}}, nil
}

// addFilters puts each pool's ext_proc filter before the router of every HTTP connection manager.
func addFilters(l *listenerv3.Listener, pools []pool) error {
	chains := append([]*listenerv3.FilterChain{}, l.GetFilterChains()...)
	if l.GetDefaultFilterChain() != nil {
		chains = append(chains, l.GetDefaultFilterChain())
	}
	for _, chain := range chains {
		for _, f := range chain.GetFilters() {
			if f.GetName() != hcmName {
				continue
			}
			hcm := &hcmv3.HttpConnectionManager{}
			if err := f.GetTypedConfig().UnmarshalTo(hcm); err != nil {
				return err
			}
			var filters []*hcmv3.HttpFilter
			for _, p := range pools {
				ext, err := extProc(p)
				if err != nil {
					return err
				}
				filters = append(filters, ext)
			}
			served, err := servedToMetadata()
			if err != nil {
				return err
			}
			// After the pickers: a response passes the filters in reverse, so the metadata is set
			// before a picker sees the response.
			filters = append(filters, served)
			n := len(hcm.HttpFilters)
			if n > 0 && strings.HasSuffix(hcm.HttpFilters[n-1].GetName(), "router") {
				hcm.HttpFilters = append(hcm.HttpFilters[:n-1:n-1], append(filters, hcm.HttpFilters[n-1])...)
			} else {
				hcm.HttpFilters = append(filters, hcm.HttpFilters...)
			}
			cfg, err := anypb.New(hcm)
			if err != nil {
				return err
			}
			f.ConfigType = &listenerv3.Filter_TypedConfig{TypedConfig: cfg}
		}
	}
	return nil
}

// servedToMetadata hands the picker the endpoint that served, as the protocol says: the response
// header a pool's route adds (the upstream's address, after any retry) becomes envoy.lb metadata, which
// the picker's filter forwards with the response, and leaves the response.
func servedToMetadata() (*hcmv3.HttpFilter, error) {
	cfg, err := anypb.New(&h2mv3.Config{ResponseRules: []*h2mv3.Config_Rule{{
		Header: servedHeader,
		OnHeaderPresent: &h2mv3.Config_KeyValuePair{
			MetadataNamespace: lbNamespace, Key: servedHeader, Type: h2mv3.Config_STRING,
		},
		Remove: true,
	}}})
	if err != nil {
		return nil, err
	}
	return &hcmv3.HttpFilter{Name: servedFilter, ConfigType: &hcmv3.HttpFilter_TypedConfig{TypedConfig: cfg}}, nil
}

// served is the response header a pool's route adds: the address of the upstream that answered.
var served = &corev3.HeaderValueOption{
	Header:       &corev3.HeaderValue{Key: servedHeader, Value: "%UPSTREAM_REMOTE_ADDRESS%"},
	AppendAction: corev3.HeaderValueOption_OVERWRITE_IF_EXISTS_OR_ADD,
}

// enableOnRoutes turns the pool's filter on where a route, or one of its weighted clusters, sends to
// the pool (a weighted cluster is chosen when the route is, before the filters run), and has the
// response say which endpoint served.
func enableOnRoutes(rc *routev3.RouteConfiguration, pools map[string]pool) error {
	on, err := anypb.New(&routev3.FilterConfig{Config: mustAny(&extprocv3.ExtProcPerRoute{
		Override: &extprocv3.ExtProcPerRoute_Overrides{Overrides: &extprocv3.ExtProcOverrides{}},
	})})
	if err != nil {
		return err
	}
	for _, vh := range rc.GetVirtualHosts() {
		for _, r := range vh.GetRoutes() {
			action := r.GetRoute()
			if action == nil {
				continue
			}
			if p, ok := pools[action.GetCluster()]; ok {
				if r.TypedPerFilterConfig == nil {
					r.TypedPerFilterConfig = map[string]*anypb.Any{}
				}
				r.TypedPerFilterConfig[p.filterName()] = on
				r.ResponseHeadersToAdd = append(r.ResponseHeadersToAdd, served)
			}
			for _, wc := range action.GetWeightedClusters().GetClusters() {
				if p, ok := pools[wc.GetName()]; ok {
					if wc.TypedPerFilterConfig == nil {
						wc.TypedPerFilterConfig = map[string]*anypb.Any{}
					}
					wc.TypedPerFilterConfig[p.filterName()] = on
					wc.ResponseHeadersToAdd = append(wc.ResponseHeadersToAdd, served)
				}
			}
		}
	}
	return nil
}

func mustAny(m proto.Message) *anypb.Any {
	a, err := anypb.New(m)
	if err != nil {
		panic(err)
	}
	return a
}

func main() {
	listen := flag.String("listen", ":5005", "the gRPC address Envoy Gateway calls")
	flag.Parse()
	go statusLoop()
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		log.Fatalf("listen %s: %v", *listen, err)
	}
	s := grpc.NewServer()
	extension.RegisterEnvoyGatewayExtensionServer(s, server{})
	log.Printf("serving the InferencePool extension on %s", *listen)
	if err := s.Serve(lis); err != nil {
		log.Fatal(err)
	}
}
